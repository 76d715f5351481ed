//! A TCP proxy that holds back what it forwards, each way, to measure the outbox against a
//! database a network away rather than on loopback: a unit of work pays its round trips, and
//! how many it makes matters more the longer each one is.
//!
//! ```sh
//! cargo run --release --example latency_proxy -- --listen 127.0.0.1:6543 --to 127.0.0.1:5432 --delay-ms 1 &
//! OUTBOX_BENCH_DATABASE_URL=postgres://postgres@127.0.0.1:6543/postgres \
//!     cargo run --release --example relay_bench -- --phases 6
//! ```
//!
//! Each chunk read from one side is written to the other `--delay-ms` after it was read (tokio's
//! timers have a resolution of one millisecond and wait for their tick, so a round trip
//! through it takes more than twice the delay; `--delay-ms 0` forwards at once, and measures
//! the proxy's own hop).

use std::time::Duration;

use clap::Parser;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::Instant;

#[derive(Parser)]
#[command(about = "A TCP proxy that delays what it forwards, each way")]
struct Args {
    /// The address to listen on.
    #[arg(long)]
    listen: String,
    /// The address to forward to.
    #[arg(long)]
    to: String,
    /// How long each chunk is held back, each way, in milliseconds.
    #[arg(long, default_value_t = 0.0)]
    delay_ms: f64,
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let args = Args::parse();
    let delay = Duration::from_secs_f64(args.delay_ms / 1000.0);
    let listener = TcpListener::bind(&args.listen).await?;
    loop {
        let (client, _) = listener.accept().await?;
        let to = args.to.clone();
        tokio::spawn(async move {
            let server = match TcpStream::connect(&to).await {
                Ok(server) => server,
                Err(error) => {
                    eprintln!("latency_proxy: cannot connect to {to}: {error}");
                    return;
                }
            };
            for stream in [&client, &server] {
                let _ = stream.set_nodelay(true);
            }
            let (client_read, client_write) = client.into_split();
            let (server_read, server_write) = server.into_split();
            tokio::join!(
                forward(client_read, server_write, delay),
                forward(server_read, client_write, delay)
            );
        });
    }
}

/// Copies `from` to `to`, each chunk `delay` after it was read, in order.
async fn forward(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, delay: Duration) {
    let (chunks, mut due) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let read = async move {
        let mut buffer = vec![0; 64 * 1024];
        while let Ok(n @ 1..) = from.read(&mut buffer).await {
            if chunks
                .send((Instant::now() + delay, buffer[..n].to_vec()))
                .is_err()
            {
                break;
            }
        }
    };
    let write = async move {
        while let Some((at, chunk)) = due.recv().await {
            // A timer waits for its next tick even when due: none for no delay.
            if !delay.is_zero() {
                tokio::time::sleep_until(at).await;
            }
            if to.write_all(&chunk).await.is_err() {
                break;
            }
        }
        let _ = to.shutdown().await;
    };
    tokio::join!(read, write);
}
