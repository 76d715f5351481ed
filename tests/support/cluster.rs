//! A three-node JetStream cluster on loopback: three nats-server processes with routes to
//! each other, each on its own client and cluster ports with its own store, for the tests
//! and the benchmark that kill and restart nodes. Shared with `examples/relay_bench.rs`
//! through `#[path]`, so it depends on nothing of the tests' harness.
//!
//! The binary is `NATS_SERVER_BIN`, else `nats-server` on the PATH, else
//! `/usr/sbin/nats-server`. JetStream clustering needs each server named and the cluster
//! named (nats-server docs, "JetStream Clustering": `server_name`, `cluster.name`,
//! `cluster.routes`); a node may list itself among the routes.

#![allow(dead_code)] // each user takes part of it

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use async_nats::jetstream;

/// The nats-server binary to run: `NATS_SERVER_BIN`, else `nats-server` on the PATH, else
/// Debian's `/usr/sbin/nats-server`.
pub fn nats_server_binary() -> PathBuf {
    if let Ok(path) = std::env::var("NATS_SERVER_BIN") {
        return path.into();
    }
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("nats-server"))
            .find(|candidate| candidate.is_file())
    });
    on_path.unwrap_or_else(|| "/usr/sbin/nats-server".into())
}

/// `count` distinct free TCP ports on loopback for servers to listen on, drawn at random
/// from the 12,000 ports below the kernel's ephemeral range (Linux's
/// `net.ipv4.ip_local_port_range`, 32768-60999 by default), the range the local ports of
/// connections are drawn from: a server killed and started again on its port finds it
/// free, where a port of that range may meanwhile have become the local end of another
/// process's connection (the server then exits: "address already in use"). Each port is
/// held until all are found, so no two are the same.
pub fn free_ports(count: usize) -> Vec<u16> {
    let ephemeral_start = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32_768);
    let lowest = ephemeral_start.saturating_sub(12_000).max(1_024);
    let span = u128::from(ephemeral_start.saturating_sub(lowest).max(1));
    let mut held = Vec::with_capacity(count);
    for _ in 0..100_000 {
        if held.len() == count {
            break;
        }
        let offset = uuid::Uuid::new_v4().as_u128() % span;
        let port = lowest + u16::try_from(offset).expect("an offset under the span");
        // A port in use (by another test's server, or a service of the machine) is skipped.
        if let Ok(listener) = std::net::TcpListener::bind(("127.0.0.1", port)) {
            held.push(listener);
        }
    }
    assert_eq!(
        held.len(),
        count,
        "{count} free ports from {lowest} to {ephemeral_start}"
    );
    held.iter()
        .map(|listener| listener.local_addr().expect("a bound port").port())
        .collect()
}

/// Starts `command`, a nats-server's, its standard error (where nats-server logs) to `log`.
fn spawn_server(mut command: Command, log: std::fs::File) -> Child {
    command
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "cannot start {} (set NATS_SERVER_BIN): {e}",
                command.get_program().to_string_lossy()
            )
        })
}

struct Node {
    name: String,
    port: u16,
    cluster_port: u16,
    store: PathBuf,
    child: Option<Child>,
    /// Where its log stood when it was last started: what it logged since begins there.
    log_start: usize,
}

/// The longest a node in lame duck mode ([`NatsCluster::lame_duck`]) takes to close its
/// clients' connections, after [`LAME_DUCK_GRACE`]: the least nats-server takes (30 s; the
/// default is 2 minutes). It waits at most a second between two clients, so with the
/// tests' few it exits in seconds.
pub const LAME_DUCK_DURATION: Duration = Duration::from_secs(30);

/// How long a node in lame duck mode waits before it closes its first client's connection.
pub const LAME_DUCK_GRACE: Duration = Duration::from_secs(1);

/// Three nats-server processes forming one JetStream cluster. Dropping it kills them and
/// removes their stores.
pub struct NatsCluster {
    name: String,
    nodes: Vec<Node>,
    routes: String,
}

impl NatsCluster {
    /// Starts three nodes and waits (up to 30 s) until the cluster has elected its
    /// JetStream meta leader, so that streams can be created. A port found free can be
    /// taken before its node binds it (by another test's server): that node exits, and the
    /// cluster, which never elects a meta leader without it, is started again on other
    /// ports, up to three times.
    pub async fn start() -> Self {
        let mut failures = Vec::new();
        for _ in 0..3 {
            let mut cluster = Self::spawn_all();
            match cluster.until_all_listening().await {
                Ok(()) => {
                    cluster.until_jetstream_answers().await;
                    return cluster;
                }
                // Dropping the cluster kills its nodes and removes their stores.
                Err(failure) => failures.push(failure),
            }
        }
        panic!(
            "the cluster did not start in three attempts:\n{}",
            failures.join("\n")
        );
    }

    /// Three nodes on ports of their own, started.
    fn spawn_all() -> Self {
        let tag = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
        let ports = free_ports(6);
        let nodes: Vec<Node> = (0..3)
            .map(|i| Node {
                name: format!("n{i}-{tag}"),
                port: ports[2 * i],
                cluster_port: ports[2 * i + 1],
                store: std::env::temp_dir().join(format!("outbox-cluster-{tag}-n{i}")),
                child: None,
                log_start: 0,
            })
            .collect();
        let routes = nodes
            .iter()
            .map(|node| format!("nats://127.0.0.1:{}", node.cluster_port))
            .collect::<Vec<_>>()
            .join(",");
        let mut cluster = Self {
            name: format!("outbox-{tag}"),
            nodes,
            routes,
        };
        for node in 0..3 {
            cluster.spawn(node);
        }
        cluster
    }

    async fn until_all_listening(&mut self) -> Result<(), String> {
        for node in 0..self.nodes.len() {
            self.until_listening(node).await?;
        }
        Ok(())
    }

    /// The three client URLs, separated by commas: a server list for a client that fails
    /// over.
    pub fn urls(&self) -> String {
        (0..self.nodes.len())
            .map(|node| self.url(node))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The client URL of `node` (0, 1 or 2).
    pub fn url(&self, node: usize) -> String {
        format!("nats://127.0.0.1:{}", self.nodes[node].port)
    }

    /// The server name of `node`, as stream and connection infos report it.
    pub fn name(&self, node: usize) -> &str {
        &self.nodes[node].name
    }

    /// The node whose server name is `name`.
    pub fn node_named(&self, name: &str) -> usize {
        self.nodes
            .iter()
            .position(|node| node.name == name)
            .unwrap_or_else(|| panic!("no node is named {name}"))
    }

    /// Whether `node` runs.
    pub fn is_running(&self, node: usize) -> bool {
        self.nodes[node].child.is_some()
    }

    /// The node that leads `stream` now (its Raft group's leader), asked through `js`;
    /// waits up to 30 s while the stream has no leader (an election).
    pub async fn stream_leader(&self, js: &jetstream::Context, stream: &str) -> usize {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(mut handle) = js.get_stream(stream).await
                && let Ok(info) = handle.info().await
                && let Some(leader) = info.cluster.as_ref().and_then(|c| c.leader.clone())
            {
                return self.node_named(&leader);
            }
            assert!(
                Instant::now() < deadline,
                "stream {stream} had no leader for 30 s"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits up to 60 s until every replica of `stream` is current (none offline or lagging
    /// behind its leader), as after a killed node has rejoined and caught up.
    pub async fn until_replicas_current(&self, js: &jetstream::Context, stream: &str) {
        until_current(&format!("the replicas of {stream}"), || async {
            let mut handle = js.get_stream(stream).await.ok()?;
            handle.info().await.ok()?.cluster.clone()
        })
        .await;
    }

    /// Waits up to 60 s until every replica of `consumer` is current, as
    /// [`until_replicas_current`](Self::until_replicas_current) for a stream. A consumer has
    /// a Raft group of its own: its replica on a node that rejoined catches up apart from the
    /// stream's, and until it has, killing another node leaves the consumer without a quorum
    /// (JetStream answers 503 for it), which is two nodes down, not one.
    pub async fn until_consumer_replicas_current(
        &self,
        consumer: &jetstream::consumer::PullConsumer,
    ) {
        until_current("the replicas of the consumer", || async {
            consumer.clone().info().await.ok()?.cluster.clone()
        })
        .await;
    }

    /// Kills `node` with SIGKILL, as a crash would: no shutdown, no flush.
    pub fn kill(&mut self, node: usize) {
        if let Some(mut child) = self.nodes[node].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Shuts `node` down as an operator does in a rolling restart: lame duck mode (SIGUSR2;
    /// nats-server docs, "Lame Duck Mode"): it stops taking connections, moves its JetStream
    /// leaderships to other nodes, and after [`LAME_DUCK_GRACE`] closes its clients' connections
    /// over [`LAME_DUCK_DURATION`] and exits. Waits (up to 30 s) until it has.
    pub async fn lame_duck(&mut self, node: usize) {
        let name = self.nodes[node].name.clone();
        let mut child = self.nodes[node]
            .child
            .take()
            .unwrap_or_else(|| panic!("node {name} does not run"));
        let signalled = Command::new("kill")
            .args(["-USR2", &child.id().to_string()])
            .status()
            .expect("the kill command");
        assert!(signalled.success(), "SIGUSR2 to node {name}: {signalled}");
        let deadline = Instant::now() + Duration::from_secs(30);
        while child.try_wait().expect("the node's status").is_none() {
            if Instant::now() >= deadline {
                let _ = child.kill();
                panic!(
                    "node {name} did not exit within 30 s of lame duck mode; its log:\n{}",
                    self.log(node)
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let logged = self.log(node);
        assert!(
            logged
                .get(self.nodes[node].log_start..)
                .is_some_and(|since| since.contains("Entering lame duck mode")),
            "node {name} exited in lame duck mode; its log:\n{logged}"
        );
    }

    /// Starts `node` again, with its ports and store, and waits until it listens.
    pub async fn restart(&mut self, node: usize) {
        self.spawn(node);
        if let Err(failure) = self.until_listening(node).await {
            panic!("{failure}");
        }
    }

    fn spawn(&mut self, node: usize) {
        let routes = self.routes.clone();
        let cluster_name = self.name.clone();
        let this = &mut self.nodes[node];
        assert!(this.child.is_none(), "node {} already runs", this.name);
        std::fs::create_dir_all(&this.store).expect("the node's store");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(this.store.with_extension("log"))
            .expect("the node's log file");
        this.log_start = usize::try_from(log.metadata().expect("the log's size").len())
            .expect("a log under usize::MAX bytes");
        // What no flag sets: a shorter lame duck mode than the default 2 minutes, after a
        // grace period of 1 s, not 10.
        let config = this.store.with_extension("conf");
        std::fs::write(
            &config,
            format!(
                "lame_duck_duration: \"{}s\"\nlame_duck_grace_period: \"{}s\"\n",
                LAME_DUCK_DURATION.as_secs(),
                LAME_DUCK_GRACE.as_secs()
            ),
        )
        .expect("the node's configuration file");
        let mut command = Command::new(nats_server_binary());
        command
            .arg("-c")
            .arg(&config)
            .args([
                "-a",
                "127.0.0.1",
                "-p",
                &this.port.to_string(),
                "-js",
                "-sd",
            ])
            .arg(&this.store)
            .args(["--server_name", &this.name, "--cluster_name", &cluster_name])
            .args([
                "--cluster",
                &format!("nats://127.0.0.1:{}", this.cluster_port),
            ])
            .args(["--routes", &routes]);
        this.child = Some(spawn_server(command, log));
    }

    /// Waits up to 10 s until `node` listens for clients and for routes (it binds the
    /// routes' port after the clients', and exits when that fails); `Err`, with its log,
    /// when it exits or does not listen in time.
    async fn until_listening(&mut self, node: usize) -> Result<(), String> {
        let address = format!("127.0.0.1:{}", self.nodes[node].port);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(child) = self.nodes[node].child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                self.nodes[node].child = None;
                return Err(format!(
                    "node {} exited ({status}); its log:\n{}",
                    self.nodes[node].name,
                    self.log(node)
                ));
            }
            let logged = self.log(node);
            let routes_bound = logged
                .get(self.nodes[node].log_start..)
                .is_some_and(|since| since.contains("Listening for route connections"));
            if routes_bound && tokio::net::TcpStream::connect(&address).await.is_ok() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "node {} did not listen within 10 s; its log:\n{logged}",
                    self.nodes[node].name
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn until_jetstream_answers(&self) {
        let servers: Vec<async_nats::ServerAddr> = (0..self.nodes.len())
            .map(|node| self.url(node).parse().expect("a server address"))
            .collect();
        let client = async_nats::connect(servers)
            .await
            .expect("connect to the cluster");
        // On a cluster, an answer without an `error` means a meta leader serves the API.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let Err(answer) = serves_jetstream_api(&client, "$JS.API").await else {
                return;
            };
            assert!(
                Instant::now() < deadline,
                "JetStream did not answer within 30 s ({answer}); the nodes' logs:\n{}",
                (0..self.nodes.len())
                    .map(|node| format!("--- node {node}:\n{}", self.log(node)))
                    .collect::<String>()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// `node`'s log so far.
    pub fn log(&self, node: usize) -> String {
        std::fs::read_to_string(self.nodes[node].store.with_extension("log")).unwrap_or_default()
    }
}

impl Drop for NatsCluster {
    fn drop(&mut self) {
        for node in 0..self.nodes.len() {
            self.kill(node);
            let store = &self.nodes[node].store;
            let _ = std::fs::remove_dir_all(store);
            let _ = std::fs::remove_file(store.with_extension("log"));
            let _ = std::fs::remove_file(store.with_extension("conf"));
        }
    }
}

/// Whether a JetStream answers its API at `api` (`$JS.API`, `$JS.<domain>.API`) through
/// `client`: `Err` with what came back instead. async-nats's account info does not decode
/// 2.9's answer, so the raw request: an answer without an `error` is JetStream serving it.
async fn serves_jetstream_api(client: &async_nats::Client, api: &str) -> Result<(), String> {
    let reply = client
        .request(format!("{api}.INFO"), "".into())
        .await
        .map_err(|error| error.to_string())?;
    match outbox_runtime::serde_json::from_slice::<outbox_runtime::serde_json::Value>(
        &reply.payload,
    ) {
        Ok(info) if info.get("error").is_none() => Ok(()),
        Ok(info) => Err(info.to_string()),
        Err(error) => Err(error.to_string()),
    }
}

/// Waits up to 60 s until the Raft group `read` reports (a stream's or a consumer's) has a
/// leader and every replica is current: none offline, none lagging.
async fn until_current<F, Fut>(what: &str, mut read: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<jetstream::stream::ClusterInfo>>,
{
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let cluster = read().await;
        if let Some(cluster) = &cluster
            && cluster.leader.is_some()
            && cluster
                .replicas
                .iter()
                .all(|replica| replica.current && !replica.offline && replica.lag.unwrap_or(0) == 0)
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what} did not catch up within 60 s; last read: {}",
            cluster.map_or_else(
                || "nothing (no answer)".to_owned(),
                |cluster| format!(
                    "leader {:?}, replicas {:?}",
                    cluster.leader,
                    cluster
                        .replicas
                        .iter()
                        .map(|r| format!(
                            "{} current {} offline {} lag {:?}",
                            r.name, r.current, r.offline, r.lag
                        ))
                        .collect::<Vec<_>>()
                )
            )
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A hub and a leaf node, each a nats-server with JetStream in a domain of its own (`hub`,
/// `leaf`), the leaf linked to the hub (nats-server docs, "JetStream on Leaf Nodes": a
/// server's `jetstream.domain`, and a leaf's `leafnodes.remotes`): a client of the leaf
/// reaches the hub's JetStream at `$JS.hub.API.>`, its own at `$JS.API.>`. Dropping it kills
/// both and removes their stores.
pub struct HubAndLeaf {
    dir: PathBuf,
    hub_port: u16,
    leaf_port: u16,
    hub: Option<Child>,
    leaf: Option<Child>,
}

impl HubAndLeaf {
    /// The hub's JetStream domain.
    pub const HUB: &'static str = "hub";
    /// The leaf's JetStream domain.
    pub const LEAF: &'static str = "leaf";

    /// Starts the hub, then the leaf, and waits (up to 30 s) until a client of the leaf gets
    /// answers from both JetStreams.
    pub async fn start() -> Self {
        let tag = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
        let dir = std::env::temp_dir().join(format!("outbox-leaf-{tag}"));
        std::fs::create_dir_all(&dir).expect("the servers' directory");
        let ports = free_ports(3);
        let (hub_port, leaf_link_port, leaf_port) = (ports[0], ports[1], ports[2]);
        let mut servers = Self {
            dir,
            hub_port,
            leaf_port,
            hub: None,
            leaf: None,
        };
        servers.configure(
            Self::HUB,
            hub_port,
            &format!("leafnodes {{ listen: \"127.0.0.1:{leaf_link_port}\" }}"),
        );
        servers.configure(
            Self::LEAF,
            leaf_port,
            &format!(
                "leafnodes {{ remotes: [ {{ url: \"nats-leaf://127.0.0.1:{leaf_link_port}\" }} ] }}"
            ),
        );
        servers.hub = Some(servers.spawn(Self::HUB));
        servers.leaf = Some(servers.spawn(Self::LEAF));
        servers.until_both_answer().await;
        servers
    }

    /// Writes the configuration of the server of `domain`, its name too.
    fn configure(&self, domain: &str, port: u16, leafnodes: &str) {
        let store = self.dir.join(format!("{domain}-store"));
        std::fs::write(
            self.dir.join(format!("{domain}.conf")),
            format!(
                "server_name: {domain}\nlisten: \"127.0.0.1:{port}\"\n\
                 jetstream {{ store_dir: {store:?}, domain: {domain} }}\n{leafnodes}\n"
            ),
        )
        .expect("the server's configuration");
    }

    /// Starts the server of `domain`, appending to its log.
    fn spawn(&self, domain: &str) -> Child {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(format!("{domain}.log")))
            .expect("the server's log");
        let mut command = Command::new(nats_server_binary());
        command
            .arg("-c")
            .arg(self.dir.join(format!("{domain}.conf")));
        spawn_server(command, log)
    }

    /// Kills the hub with SIGKILL: the leaf's link to it is down until
    /// [`restart_hub`](Self::restart_hub).
    pub fn kill_hub(&mut self) {
        if let Some(mut hub) = self.hub.take() {
            let _ = hub.kill();
            let _ = hub.wait();
        }
    }

    /// Starts the hub again, on its ports and store, and waits (up to 30 s) until a client of
    /// the leaf gets answers from both JetStreams again (the leaf retries its link every
    /// second, nats-server's default `reconnect`).
    pub async fn restart_hub(&mut self) {
        assert!(self.hub.is_none(), "the hub runs");
        self.hub = Some(self.spawn(Self::HUB));
        self.until_both_answer().await;
    }

    /// The hub's client URL.
    pub fn hub_url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.hub_port)
    }

    /// The leaf node's client URL.
    pub fn leaf_url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.leaf_port)
    }

    async fn until_both_answer(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut client = None;
        loop {
            if client.is_none() {
                client = async_nats::connect(self.leaf_url()).await.ok();
            }
            let mut answers = Vec::new();
            if let Some(client) = &client {
                let hub = format!("$JS.{}.API", Self::HUB);
                for api in ["$JS.API", hub.as_str()] {
                    answers.push(serves_jetstream_api(client, api).await.is_ok());
                }
            }
            if answers == [true, true] {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the leaf's client got no answer of both JetStreams within 30 s ({answers:?}); \
                 the logs:\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Both servers' logs so far.
    pub fn logs(&self) -> String {
        [Self::HUB, Self::LEAF]
            .iter()
            .map(|domain| {
                let log = std::fs::read_to_string(self.dir.join(format!("{domain}.log")));
                format!("--- {domain}:\n{}", log.unwrap_or_default())
            })
            .collect()
    }
}

impl Drop for HubAndLeaf {
    fn drop(&mut self) {
        for child in [self.hub.take(), self.leaf.take()].into_iter().flatten() {
            let mut child = child;
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
