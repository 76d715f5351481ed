// The unit of work's handle is borrowed for the closure only: keeping it to emit events
// after the commit does not compile.
use diesel_async::AsyncPgConnection;
use outbox_runtime::{Outbox, UnitOfWorkError};

async fn keep_the_handle(conn: &mut AsyncPgConnection) {
    let mut kept = None;
    Outbox::new()
        .transaction(conn, async |uow| {
            kept = Some(uow);
            Ok::<_, UnitOfWorkError>(())
        })
        .await
        .unwrap();
}

fn main() {}
