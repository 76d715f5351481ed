// A unit of work runs on a connection the toolkit has statements for, or a deadpool guard of
// one; anything else (here another pool's guard) is refused with what to pass instead.
use outbox_runtime::{Outbox, UnitOfWorkError};

struct OtherPoolsGuard;

async fn save(outbox: &Outbox, guard: &mut OtherPoolsGuard) -> Result<(), UnitOfWorkError> {
    outbox
        .transaction(guard, async |_uow| Ok::<_, UnitOfWorkError>(()))
        .await
}

fn main() {}
