// There is no way to make a unit of work but Outbox::transaction.
use diesel_async::AsyncPgConnection;
use outbox_runtime::UnitOfWork;

fn make(conn: &mut AsyncPgConnection) {
    let _uow = UnitOfWork { conn };
    let _uow = UnitOfWork::new(conn);
}

fn main() {}
