//! Roles of a test's own: each logs in with a password, and holds what `outbox grants` gives
//! it (`outbox_runtime::privileges::grants`), on the test's database only.

use diesel_async::SimpleAsyncConnection;
use outbox_runtime::privileges::{self, Component};

use super::TestEnv;

/// A role of the test's own, which logs in with a password (so the test holds where the
/// server asks for one), and the URL of the test's database as that role.
pub struct Role {
    pub name: String,
    pub url: String,
}

/// Creates the role `{prefix}_{what}` and grants it, as the tables' owner, what each of
/// `components` needs, by the statements [`privileges::grants`] writes.
pub async fn role(env: &TestEnv, what: &str, components: &[Component]) -> Role {
    let name = format!("{}_{what}", env.prefix);
    let mut owner = env.conn().await;
    owner
        .batch_execute(&format!("CREATE ROLE {name} LOGIN PASSWORD 'pw'"))
        .await
        .unwrap();
    for component in components {
        let grants = privileges::grants(*component, &name, "public").unwrap();
        owner
            .batch_execute(&grants)
            .await
            .unwrap_or_else(|e| panic!("the grants of the {component}: {e}\n{grants}"));
    }
    Role {
        url: as_role(&env.database_url, &name),
        name,
    }
}

/// `url` with `role` and its password for its user.
pub fn as_role(url: &str, role: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap();
    let authority = rest.split('/').next().unwrap_or_default();
    let host = match authority.rsplit_once('@') {
        Some((user, _)) => &rest[user.len() + 1..],
        None => rest,
    };
    format!("{scheme}://{role}:pw@{host}")
}

/// Drops the roles, their privileges first (the database keeps the only ones they hold).
pub async fn drop_roles(env: &TestEnv, roles: &[&Role]) {
    let mut owner = env.conn().await;
    for role in roles {
        owner
            .batch_execute(&format!("DROP OWNED BY {0}; DROP ROLE {0}", role.name))
            .await
            .unwrap();
    }
}
