//! Static SQL statements that diesel prepares once per connection.
//!
//! diesel never caches a `sql_query` as a prepared statement (it cannot know the SQL is
//! static), so each call is parsed and planned again: 1.6 ms of planning for the relay's
//! claim, and a planned INSERT in every unit of work. [`statement!`] declares a statement
//! whose SQL is a constant and whose binds are typed fields; it has a static `QueryId`, so
//! diesel's statement cache keys it by type and plans it once per connection.
//!
//! The SQL uses each placeholder `$1`, `$2`, ... exactly once, in order: the binds are
//! emitted where their placeholders stand.

use diesel::pg::Pg;
use diesel::query_builder::AstPass;

/// Writes a statement's SQL into `out`, with `bind(k, out)` emitting bind `k` (1-based)
/// where `$k` stands. The SQL is split at its placeholders once per statement type and kept
/// in `pieces`: diesel-async renders a statement's SQL at every execution, even a cached one.
pub(crate) fn walk_sql<'b>(
    sql: &'static str,
    binds: usize,
    pieces: &'static std::sync::OnceLock<Result<Vec<&'static str>, String>>,
    mut out: AstPass<'_, 'b, Pg>,
    mut bind: impl FnMut(usize, &mut AstPass<'_, 'b, Pg>) -> diesel::QueryResult<()>,
) -> diesel::QueryResult<()> {
    let pieces = pieces
        .get_or_init(|| split(sql, binds))
        .as_ref()
        .map_err(|e| diesel::result::Error::QueryBuilderError(e.clone().into()))?;
    for (k, piece) in pieces.iter().enumerate() {
        out.push_sql(piece);
        if k < binds {
            bind(k + 1, &mut out)?;
        }
    }
    Ok(())
}

/// `sql` cut at `$1`, `$2`, ... `$binds`: `binds + 1` pieces.
fn split(sql: &'static str, binds: usize) -> Result<Vec<&'static str>, String> {
    let mut pieces = Vec::with_capacity(binds + 1);
    let mut rest = sql;
    for k in 1..=binds {
        let (before, after) = split_at_placeholder(rest, k)
            .ok_or_else(|| format!("statement SQL lacks placeholder ${k} in order: {sql}"))?;
        pieces.push(before);
        rest = after;
    }
    pieces.push(rest);
    Ok(pieces)
}

/// Splits `sql` around the first `$k` that is not part of a longer number.
fn split_at_placeholder(sql: &'static str, k: usize) -> Option<(&'static str, &'static str)> {
    let placeholder = format!("${k}");
    let mut from = 0;
    while let Some(found) = sql[from..].find(&placeholder) {
        let start = from + found;
        let end = start + placeholder.len();
        if !sql[end..].starts_with(|c: char| c.is_ascii_digit()) {
            return Some((&sql[..start], &sql[end..]));
        }
        from = end;
    }
    None
}

/// Declares a statement: a struct of typed binds with a constant SQL text, usable with
/// diesel-async's `execute` and `load` (into `QueryableByName` rows), prepared once per
/// connection. Each field is bound as its SQL type where its placeholder stands, in order.
macro_rules! statement {
    (
        $(#[$attr:meta])*
        $vis:vis struct $name:ident<$lt:lifetime> {
            $($field:ident: $ty:ty => $sql_type:ty),* $(,)?
        }
        sql = $sql:expr;
    ) => {
        $(#[$attr])*
        $vis struct $name<$lt> {
            $(pub $field: $ty,)*
        }
        $crate::outbox::statement::statement!(@impls [$lt] $name<$lt>, $name<'static>, $sql, $($field => $sql_type),*);
    };
    (
        $(#[$attr:meta])*
        $vis:vis struct $name:ident {
            $($field:ident: $ty:ty => $sql_type:ty),* $(,)?
        }
        sql = $sql:expr;
    ) => {
        $(#[$attr])*
        $vis struct $name {
            $(pub $field: $ty,)*
        }
        $crate::outbox::statement::statement!(@impls [] $name, $name, $sql, $($field => $sql_type),*);
    };
    (@impls [$($lt:lifetime)?] $self_ty:ty, $query_id:ty, $sql:expr, $($field:ident => $sql_type:ty),*) => {
        impl<$($lt)?> $self_ty {
            pub(crate) const SQL: &'static str = $sql;
        }

        impl<$($lt)?> diesel::query_builder::QueryId for $self_ty {
            type QueryId = $query_id;
            const HAS_STATIC_QUERY_ID: bool = true;
        }

        impl<$($lt)?> diesel::query_builder::Query for $self_ty {
            type SqlType = diesel::sql_types::Untyped;
        }

        // For sync connections (diesel-async's trait has a blanket implementation).
        impl<$($lt,)? Conn> diesel::RunQueryDsl<Conn> for $self_ty {}

        impl<$($lt)?> diesel::query_builder::QueryFragment<diesel::pg::Pg> for $self_ty {
            fn walk_ast<'b>(
                &'b self,
                out: diesel::query_builder::AstPass<'_, 'b, diesel::pg::Pg>,
            ) -> diesel::QueryResult<()> {
                static PIECES: std::sync::OnceLock<Result<Vec<&'static str>, String>> =
                    std::sync::OnceLock::new();
                let binds: &[&str] = &[$(stringify!($field)),*];
                $crate::outbox::statement::walk_sql(Self::SQL, binds.len(), &PIECES, out, |k, out| {
                    let mut index = 0;
                    $(
                        index += 1;
                        if index == k {
                            return out.push_bind_param::<$sql_type, _>(&self.$field);
                        }
                    )*
                    unreachable!("bind {k} of {}", binds.len())
                })
            }
        }
    };
}

pub(crate) use statement;

#[cfg(test)]
mod tests {
    use super::split_at_placeholder;

    #[test]
    fn placeholders_split_whole_numbers_only() {
        assert_eq!(
            split_at_placeholder("a $1 b $12 c", 1),
            Some(("a ", " b $12 c"))
        );
        assert_eq!(
            split_at_placeholder("x $12 y $1", 1),
            Some(("x $12 y ", ""))
        );
        assert_eq!(split_at_placeholder("x $12", 1), None);
        assert_eq!(split_at_placeholder("x $12", 12), Some(("x ", "")));
    }
}
