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

/// A one-dimensional array bind, written in PostgreSQL's binary array format in one piece.
///
/// diesel's `ToSql<Array<_>>` for a slice serialises each element through a fresh `Output`
/// and grows the bind's buffer from empty, a few reallocations per array: 1.6 k
/// instructions for an array of one element, where the unit of work's statement binds twelve
/// arrays (callgrind, a unit of work of one event). This one computes the size first and
/// writes the header and the elements into one buffer of that size.
///
/// The format (PostgreSQL source, `array_recv` and `array_send` in
/// src/backend/utils/adt/arrayfuncs.c): the number of dimensions (1, or 0 for an empty
/// array), a flags word (0: no nulls), the element type's OID, then per dimension its length
/// and lower bound (1), then per element its length in bytes and its bytes in the element
/// type's binary format. The server checks the OID against the parameter's element type, so
/// a mismatch is an error, never a misread.
#[derive(Debug)]
pub(crate) struct ArrayBind<'a, T: Clone>(pub std::borrow::Cow<'a, [T]>);

impl<T: Clone> FromIterator<T> for ArrayBind<'_, T> {
    fn from_iter<I: IntoIterator<Item = T>>(iter: I) -> Self {
        Self(std::borrow::Cow::Owned(iter.into_iter().collect()))
    }
}

impl<T: Clone> From<Vec<T>> for ArrayBind<'_, T> {
    fn from(elements: Vec<T>) -> Self {
        Self(std::borrow::Cow::Owned(elements))
    }
}

impl<'a, T: Clone> From<&'a [T]> for ArrayBind<'a, T> {
    fn from(elements: &'a [T]) -> Self {
        Self(std::borrow::Cow::Borrowed(elements))
    }
}

/// An element type of [`ArrayBind`]: its SQL type, its OID (PostgreSQL's `pg_type.dat`) and
/// its binary format; and, for a statement sent as text ([`Literals`]), its type's name and
/// its text inside an array constant.
pub(crate) trait ArrayElement: Clone + std::fmt::Debug {
    /// The element's SQL type.
    type Sql: diesel::sql_types::SqlType + diesel::sql_types::SingleValue;
    /// The element type's OID.
    const OID: u32;
    /// The element type's name in SQL.
    const NAME: &'static str;
    /// The bytes of its binary format.
    fn bytes(&self) -> impl AsRef<[u8]>;
    /// Writes the element as it stands in an array's text (PostgreSQL 15 documentation,
    /// 8.15.6 "Array Input and Output Syntax") inside an escape string constant (see
    /// [`write_string_constant`]); `false`, and nothing written, for a value no constant can
    /// hold (a text with a NUL).
    fn write_array_element(&self, sql: &mut String) -> bool;
}

impl ArrayElement for &str {
    type Sql = diesel::sql_types::Text;
    const OID: u32 = 25;
    const NAME: &'static str = "text";
    fn bytes(&self) -> impl AsRef<[u8]> {
        self.as_bytes()
    }
    fn write_array_element(&self, sql: &mut String) -> bool {
        write_array_text(sql, self)
    }
}

impl ArrayElement for i64 {
    type Sql = diesel::sql_types::Int8;
    const OID: u32 = 20;
    const NAME: &'static str = "int8";
    fn bytes(&self) -> impl AsRef<[u8]> {
        self.to_be_bytes()
    }
    fn write_array_element(&self, sql: &mut String) -> bool {
        sql.push_str(itoa::Buffer::new().format(*self));
        true
    }
}

impl ArrayElement for i32 {
    type Sql = diesel::sql_types::Int4;
    const OID: u32 = 23;
    const NAME: &'static str = "int4";
    fn bytes(&self) -> impl AsRef<[u8]> {
        self.to_be_bytes()
    }
    fn write_array_element(&self, sql: &mut String) -> bool {
        sql.push_str(itoa::Buffer::new().format(*self));
        true
    }
}

impl ArrayElement for uuid::Uuid {
    type Sql = diesel::sql_types::Uuid;
    const OID: u32 = 2950;
    const NAME: &'static str = "uuid";
    fn bytes(&self) -> impl AsRef<[u8]> {
        *self.as_bytes()
    }
    fn write_array_element(&self, sql: &mut String) -> bool {
        // Hex digits and hyphens only: nothing to quote.
        sql.push_str(
            self.hyphenated()
                .encode_lower(&mut uuid::Uuid::encode_buffer()),
        );
        true
    }
}

/// Writes `value` as a PostgreSQL escape string constant, `E'...'`, which reads the same
/// whatever the session's `standard_conforming_strings`: each `\` is written `\\`, each `'`
/// is written `''`, and every other character stands for itself (PostgreSQL 15
/// documentation, 4.1.2.2 "String Constants with C-Style Escapes"). In UTF-8, the bytes of a
/// multi-byte character are never those of `'` or `\`, and the connection's client encoding
/// is UTF-8: tokio-postgres asks for it at startup, diesel-async sets it again when it
/// connects, and both send and read every text as UTF-8 (a session switched to another
/// client encoding, such as SJIS, whose multi-byte characters may end in the byte of `\`,
/// would misread their binds and results too). `false`, and nothing written, when
/// `value` holds a NUL: no `text` can, and a simple query ends at the first NUL (55.7,
/// "String").
pub(crate) fn write_string_constant(sql: &mut String, value: &str) -> bool {
    write_escaped(
        sql,
        value,
        ("E'", "'"),
        &['\'', '\\'],
        |special| match special {
            b'\'' => "''",
            _ => "\\\\",
        },
    )
}

/// Writes `value` as a double-quoted element of an array's text, itself inside an escape
/// string constant: the array's text escapes `"` and `\` with a `\` (PostgreSQL 15
/// documentation, 8.15.6), and the constant then doubles each `\` and each `'`
/// ([`write_string_constant`]), so `"` is written `\\"`, `\` is written `\\\\`, and `'` is
/// written `''`. Quoted, an element reads as the text it holds, even `NULL` or one with
/// braces, commas or spaces. `false`, and nothing written, when `value` holds a NUL.
pub(crate) fn write_array_text(sql: &mut String, value: &str) -> bool {
    write_escaped(
        sql,
        value,
        ("\"", "\""),
        &['\'', '\\', '"'],
        |special| match special {
            b'\'' => "''",
            b'"' => "\\\\\"",
            _ => "\\\\\\\\",
        },
    )
}

/// Writes `value` between `quotes`, each of the ASCII characters `specials` replaced by
/// `escape` of its byte; `false`, and nothing written, when `value` holds a NUL.
fn write_escaped(
    sql: &mut String,
    value: &str,
    quotes: (&str, &str),
    specials: &[char],
    escape: fn(u8) -> &'static str,
) -> bool {
    if value.contains('\0') {
        return false;
    }
    sql.reserve(value.len() + quotes.0.len() + quotes.1.len());
    sql.push_str(quotes.0);
    let mut rest = value;
    while let Some(at) = rest.find(specials) {
        let (before, special) = rest.split_at(at);
        sql.push_str(before);
        sql.push_str(escape(special.as_bytes()[0]));
        rest = &special[1..];
    }
    sql.push_str(rest);
    sql.push_str(quotes.1);
    true
}

/// A statement written with its values as constants, sent as a simple query (where a
/// statement with binds takes the extended protocol): several statements then go in one
/// round trip, in order, and the server stops at the first that fails (PostgreSQL 15
/// documentation, 55.2.2.1 "Multiple Statements in a Simple Query"). Each array is one
/// escape string constant holding the array's text, `E'{e1,e2,...}'::type[]`, each text
/// element double-quoted ([`write_array_text`]), each text an escape string constant
/// ([`write_string_constant`]). The server parses an array's text in one call of the type's
/// input function, where `ARRAY[c1, c2, ...]` took a parse node and a coercion per element:
/// a unit of work of 100 events on as many aggregates took 8.2-8.5 ms that way, 6.8-7.1 ms
/// with the arrays' texts, 6.8-6.9 ms with binds (on loopback, interleaved, 2026-11-27).
pub(crate) struct Literals {
    sql: String,
    /// Whether every value could be written.
    whole: bool,
}

impl Literals {
    /// An empty text of about `capacity` bytes.
    pub(crate) fn with_capacity(capacity: usize) -> Self {
        Self {
            sql: String::with_capacity(capacity),
            whole: true,
        }
    }

    /// Appends SQL as it is.
    pub(crate) fn sql(&mut self, sql: &str) -> &mut Self {
        self.sql.push_str(sql);
        self
    }

    /// Appends `value` as a text constant.
    pub(crate) fn text(&mut self, value: &str) -> &mut Self {
        self.whole &= write_string_constant(&mut self.sql, value);
        self
    }

    /// Appends `elements` as an array constant of their type.
    pub(crate) fn array<T: ArrayElement>(&mut self, elements: &ArrayBind<'_, T>) -> &mut Self {
        self.sql.push_str("E'{");
        for (k, element) in elements.0.iter().enumerate() {
            if k > 0 {
                self.sql.push(',');
            }
            self.whole &= element.write_array_element(&mut self.sql);
        }
        self.sql.push_str("}'::");
        self.sql.push_str(T::NAME);
        self.sql.push_str("[]");
        self
    }

    /// The text, or `None` when a value could not be written as a constant.
    pub(crate) fn finish(self) -> Option<String> {
        self.whole.then_some(self.sql)
    }
}

impl<T: ArrayElement> diesel::serialize::ToSql<diesel::sql_types::Array<T::Sql>, Pg>
    for ArrayBind<'_, T>
{
    fn to_sql<'b>(
        &'b self,
        out: &mut diesel::serialize::Output<'b, '_, Pg>,
    ) -> diesel::serialize::Result {
        use std::io::Write as _;
        out.write_all(&encoded(&self.0)?)?;
        Ok(diesel::serialize::IsNull::No)
    }
}

/// `elements` in PostgreSQL's binary array format (see [`ArrayBind`]).
fn encoded<T: ArrayElement>(elements: &[T]) -> Result<Vec<u8>, String> {
    let length = |n: usize| {
        i32::try_from(n).map_err(|_| {
            format!(
                "an array bind of {n} elements, or an element of {n} bytes, is over \
                 PostgreSQL's limit"
            )
        })
    };
    let size = 20
        + elements
            .iter()
            .map(|element| 4 + element.bytes().as_ref().len())
            .sum::<usize>();
    let mut buffer = Vec::with_capacity(size);
    // An empty array has no dimensions, as `array_send` writes it.
    let dimensions = i32::from(!elements.is_empty());
    buffer.extend_from_slice(&dimensions.to_be_bytes());
    buffer.extend_from_slice(&0_i32.to_be_bytes());
    buffer.extend_from_slice(&T::OID.to_be_bytes());
    if elements.is_empty() {
        return Ok(buffer);
    }
    buffer.extend_from_slice(&length(elements.len())?.to_be_bytes());
    buffer.extend_from_slice(&1_i32.to_be_bytes());
    for element in elements {
        let bytes = element.bytes();
        let bytes = bytes.as_ref();
        buffer.extend_from_slice(&length(bytes.len())?.to_be_bytes());
        buffer.extend_from_slice(bytes);
    }
    Ok(buffer)
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
            // A statement without binds leaves the bind closure's counter and pass unused.
            #[allow(unused_mut, unused_variables)]
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
    use super::{
        ArrayElement, encoded, split_at_placeholder, write_array_text, write_string_constant,
    };

    /// The bytes `array_send` gives for the same arrays (PostgreSQL 15: `SELECT
    /// array_send(ARRAY['ab', 'é']::text[])` and the others below).
    #[test]
    fn arrays_are_written_in_postgresqls_binary_format() {
        fn hex<T: ArrayElement>(elements: &[T]) -> String {
            encoded(elements)
                .unwrap()
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect()
        }
        assert_eq!(
            hex(&["ab", "\u{e9}"]),
            "00000001000000000000001900000002000000010000000261620000000\
             2c3a9"
        );
        assert_eq!(
            hex(&[-1_i64]),
            "0000000100000000000000140000000100000001000000\
             08ffffffffffffffff"
        );
        assert_eq!(
            hex(&[7_i32]),
            "000000010000000000000017000000010000000100000004\
             00000007"
        );
        let id = uuid::Uuid::from_u128(0x0102_0304_0506_0708_090a_0b0c_0d0e_0f10);
        assert_eq!(
            hex(&[id]),
            "000000010000000000000b8600000001000000010000001\
             00102030405060708090a0b0c0d0e0f10"
        );
        assert_eq!(hex::<&str>(&[]), "000000000000000000000019");
    }

    #[test]
    fn string_constants_double_quotes_and_backslashes_and_refuse_a_nul() {
        let constant = |value: &str| {
            let mut sql = String::from("x");
            write_string_constant(&mut sql, value).then_some(sql)
        };
        assert_eq!(constant("").as_deref(), Some("xE''"));
        assert_eq!(constant("it's").as_deref(), Some("xE'it''s'"));
        assert_eq!(constant(r"a\b").as_deref(), Some(r"xE'a\\b'"));
        assert_eq!(constant(r"\'").as_deref(), Some(r"xE'\\'''"));
        assert_eq!(constant("$$\n\u{e9}").as_deref(), Some("xE'$$\n\u{e9}'"));
        assert_eq!(constant("a\0b"), None);
    }

    #[test]
    fn array_texts_quote_their_elements_and_refuse_a_nul() {
        let element = |value: &str| {
            let mut sql = String::from("x");
            write_array_text(&mut sql, value).then_some(sql)
        };
        assert_eq!(element("").as_deref(), Some(r#"x"""#));
        assert_eq!(element("NULL").as_deref(), Some(r#"x"NULL""#));
        assert_eq!(element("{a, b}").as_deref(), Some(r#"x"{a, b}""#));
        assert_eq!(element("it's").as_deref(), Some(r#"x"it''s""#));
        assert_eq!(
            element(r#"say "hi""#).as_deref(),
            Some(r#"x"say \\"hi\\"""#)
        );
        assert_eq!(element(r"a\b").as_deref(), Some(r#"x"a\\\\b""#));
        assert_eq!(element("\u{e9}\n").as_deref(), Some("x\"\u{e9}\n\""));
        assert_eq!(element("a\0b"), None);
    }

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
