use diesel_async::AsyncPgConnection;
use outbox_runtime::{Outbox, UnitOfWorkError};

async fn return_the_handle(conn: &mut AsyncPgConnection) {
    let _uow = Outbox::new()
        .transaction(conn, async |uow| Ok::<_, UnitOfWorkError>(uow))
        .await
        .unwrap();
}

fn main() {}
