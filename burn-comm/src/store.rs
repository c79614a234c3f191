//! A small key-value store over TCP, served by rank 0, through which the processes of a job
//! find each other (PyTorch's `TCPStore`): `set`, `get` (waits for the key), `wait`, `add`
//! (an atomic counter) and `barrier`, each bounded by a timeout.
//!
//! Wire format, one request and one reply per round trip, integers little-endian:
//! request `op: u8, timeout_ms: u64, key: u32 len + bytes, value: u32 len + bytes`;
//! reply `status: u8 (0 ok, 1 timed out, 2 refused), value: u32 len + bytes`.

use std::collections::HashMap;
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use crate::sync::lock;

/// What a store call can fail with.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The server could not be reached, or the connection broke.
    #[error("store at {addr}: {source}")]
    Io {
        /// The server's address.
        addr: String,
        /// The cause.
        source: io::Error,
    },
    /// A key did not appear, or a barrier did not fill, in time.
    #[error("store {op} of '{key}' timed out after {after:?}")]
    Timeout {
        /// The call.
        op: &'static str,
        /// The key waited for.
        key: String,
        /// The timeout in force.
        after: Duration,
    },
    /// The server refused the request (for example `add` on a value that is not a counter).
    #[error("store {op} of '{key}' refused: {reason}")]
    Refused {
        /// The call.
        op: &'static str,
        /// The key.
        key: String,
        /// Why.
        reason: String,
    },
}

const SET: u8 = 0;
const GET: u8 = 1;
const ADD: u8 = 2;
const CHECK: u8 = 3;

/// Longest key and value a server accepts: enough for ids and addresses, and a bound on what a
/// stray client (a port scanner, an HTTP probe) can make the server allocate.
const MAX_KEY: usize = 4 << 10;
const MAX_VALUE: usize = 64 << 20;

const OK: u8 = 0;
const TIMED_OUT: u8 = 1;
const REFUSED: u8 = 2;

/// The server's table: values, and a condition variable that wakes waiters on every change;
/// and how many clients are connected, so the serving process can wait for all to hang up.
#[derive(Default)]
struct Table {
    values: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
    clients: Mutex<usize>,
    client_left: Condvar,
}

/// A running store server. It serves until the process ends (connections are cheap threads).
pub struct StoreServer {
    addr: SocketAddr,
    table: Arc<Table>,
}

impl StoreServer {
    /// Listens on `addr` (port 0 picks a free one) and serves in background threads.
    pub fn bind(addr: impl ToSocketAddrs) -> io::Result<Self> {
        let listener = TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        let table = Arc::new(Table::default());
        let served = table.clone();
        thread::Builder::new()
            .name("burn-comm-store".into())
            .spawn(move || {
                for stream in listener.incoming().flatten() {
                    let table = served.clone();
                    let _ = thread::Builder::new()
                        .name("burn-comm-store-client".into())
                        .spawn(move || serve(stream, &table));
                }
            })?;
        Ok(Self { addr, table })
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Waits until every client that has made a request has hung up; false after `timeout`.
    /// A client hangs up only after its last reply, so none loses the server in mid-call, which
    /// a key set by the last client cannot promise: the server may stop before that reply.
    pub fn wait_for_clients_to_leave(&self, timeout: Duration) -> bool {
        let until = deadline(timeout);
        let mut clients = lock(&self.table.clients);
        while *clients > 0 {
            let now = Instant::now();
            if now >= until {
                return false;
            }
            clients = self
                .table
                .client_left
                .wait_timeout(clients, until - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        true
    }
}

/// Counts a connection as a client from its first request until it ends.
struct Client<'a>(&'a Table);

impl<'a> Client<'a> {
    fn join(table: &'a Table) -> Self {
        *lock(&table.clients) += 1;
        Self(table)
    }
}

impl Drop for Client<'_> {
    fn drop(&mut self) {
        *lock(&self.0.clients) -= 1;
        self.0.client_left.notify_all();
    }
}

fn serve(stream: TcpStream, table: &Table) {
    let _ = stream.set_nodelay(true);
    let Ok(read_half) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(read_half);
    let mut writer = BufWriter::new(stream);
    // A stray connection that never sends a request is not waited for.
    let mut client = None;
    // A client that hangs up ends its thread.
    while let Ok((op, timeout, key, value)) = read_request(&mut reader) {
        client.get_or_insert_with(|| Client::join(table));
        let (status, reply) = answer(table, op, timeout, key, value);
        if write_frame(&mut writer, status, &reply).is_err() {
            return;
        }
    }
}

fn answer(table: &Table, op: u8, timeout: Duration, key: String, value: Vec<u8>) -> (u8, Vec<u8>) {
    let mut values = lock(&table.values);
    match op {
        SET => {
            values.insert(key, value);
            table.changed.notify_all();
            (OK, Vec::new())
        }
        GET => {
            let deadline = deadline(timeout);
            loop {
                if let Some(found) = values.get(&key) {
                    return (OK, found.clone());
                }
                let now = Instant::now();
                if now >= deadline {
                    return (TIMED_OUT, Vec::new());
                }
                values = table
                    .changed
                    .wait_timeout(values, deadline - now)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
        }
        ADD => {
            let Ok(delta) = <[u8; 8]>::try_from(value.as_slice()).map(i64::from_le_bytes) else {
                return (REFUSED, b"add takes an 8-byte delta".to_vec());
            };
            let current = match values.get(&key) {
                None => 0,
                Some(bytes) => match <[u8; 8]>::try_from(bytes.as_slice()) {
                    Ok(bytes) => i64::from_le_bytes(bytes),
                    Err(_) => return (REFUSED, b"the key holds a value, not a counter".to_vec()),
                },
            };
            let Some(sum) = current.checked_add(delta) else {
                return (REFUSED, b"the counter would overflow".to_vec());
            };
            values.insert(key, sum.to_le_bytes().to_vec());
            table.changed.notify_all();
            (OK, sum.to_le_bytes().to_vec())
        }
        CHECK => (OK, vec![values.contains_key(&key) as u8]),
        _ => (REFUSED, b"unknown operation".to_vec()),
    }
}

fn read_request(reader: &mut impl Read) -> io::Result<(u8, Duration, String, Vec<u8>)> {
    let mut op = [0u8; 1];
    reader.read_exact(&mut op)?;
    let mut timeout = [0u8; 8];
    reader.read_exact(&mut timeout)?;
    let key = String::from_utf8(read_bytes(reader, MAX_KEY)?)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "a key is UTF-8"))?;
    let value = read_bytes(reader, MAX_VALUE)?;
    Ok((
        op[0],
        Duration::from_millis(u64::from_le_bytes(timeout)),
        key,
        value,
    ))
}

/// A length-prefixed byte string of at most `max` bytes.
fn read_bytes(reader: &mut impl Read, max: usize) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    reader.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a frame of {len} bytes is over the limit of {max}"),
        ));
    }
    let mut bytes = Vec::with_capacity(len);
    reader.take(len as u64).read_to_end(&mut bytes)?;
    if bytes.len() < len {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok(bytes)
}

fn write_bytes(writer: &mut impl Write, bytes: &[u8]) -> io::Result<()> {
    let len = u32::try_from(bytes.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a value is at most 4 GiB"))?;
    writer.write_all(&len.to_le_bytes())?;
    writer.write_all(bytes)
}

fn write_frame(writer: &mut (impl Write + ?Sized), status: u8, value: &[u8]) -> io::Result<()> {
    let mut frame = Vec::with_capacity(5 + value.len());
    frame.push(status);
    write_bytes(&mut frame, value)?;
    writer.write_all(&frame)?;
    writer.flush()
}

/// One process's connection to the store.
pub struct Store {
    addr: String,
    stream: TcpStream,
    timeout: Duration,
    /// Set after an I/O failure: the reply stream may be out of step, so nothing more is sent.
    broken: bool,
}

/// `now + after`, or a day from now when that overflows (`Duration::MAX` means "no timeout").
pub(crate) fn deadline(after: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(after)
        .or_else(|| now.checked_add(Duration::from_secs(86_400)))
        .unwrap_or(now)
}

impl Store {
    /// Connects to the server at `addr`, retrying until `timeout` (the server may start after
    /// its clients). `timeout` also bounds every later call.
    pub fn connect(addr: &str, timeout: Duration) -> Result<Self, StoreError> {
        let until = deadline(timeout);
        let io = |source| StoreError::Io {
            addr: addr.to_string(),
            source,
        };
        loop {
            let mut last =
                io::Error::new(io::ErrorKind::NotFound, "the address resolves to nothing");
            for candidate in addr.to_socket_addrs().map_err(io)? {
                let left = until.saturating_duration_since(Instant::now());
                match TcpStream::connect_timeout(&candidate, left.max(Duration::from_millis(1))) {
                    Ok(stream) => {
                        let _ = stream.set_nodelay(true);
                        return Ok(Self {
                            addr: addr.to_string(),
                            stream,
                            timeout,
                            broken: false,
                        });
                    }
                    Err(e) => last = e,
                }
            }
            if Instant::now() >= until {
                return Err(io(last));
            }
            thread::sleep(Duration::from_millis(50));
        }
    }

    /// The server's address.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// This end's address: the interface through which this machine reaches the store's,
    /// which the other machines of the job reach too.
    pub(crate) fn local_ip(&self) -> io::Result<std::net::IpAddr> {
        Ok(self.stream.local_addr()?.ip())
    }

    /// The timeout of every call.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Sets `key` to `value`, waking everyone waiting for it.
    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.call("set", SET, key, value, Duration::ZERO)
            .map(|_| ())
    }

    /// The value of `key`, waiting until some process sets it.
    pub fn get(&mut self, key: &str) -> Result<Vec<u8>, StoreError> {
        let timeout = self.timeout;
        self.call("get", GET, key, &[], timeout)
    }

    /// Waits until every key of `keys` is set.
    pub fn wait(&mut self, keys: &[&str]) -> Result<(), StoreError> {
        let until = deadline(self.timeout);
        for key in keys {
            let left = until.saturating_duration_since(Instant::now());
            self.call("wait", GET, key, &[], left)?;
        }
        Ok(())
    }

    /// Whether `key` is set, without waiting.
    pub fn check(&mut self, key: &str) -> Result<bool, StoreError> {
        Ok(self.call("check", CHECK, key, &[], Duration::ZERO)? == [1])
    }

    /// Adds `delta` to the counter `key` (0 when unset) and returns the new value.
    pub fn add(&mut self, key: &str, delta: i64) -> Result<i64, StoreError> {
        let reply = self.call("add", ADD, key, &delta.to_le_bytes(), Duration::ZERO)?;
        let bytes = <[u8; 8]>::try_from(reply.as_slice()).map_err(|_| StoreError::Refused {
            op: "add",
            key: key.to_string(),
            reason: "the server answered with something that is not a counter".into(),
        })?;
        Ok(i64::from_le_bytes(bytes))
    }

    /// Returns once `world_size` processes have called `barrier` with the same `name`. A name
    /// can be used again: each round of `world_size` arrivals is its own generation.
    pub fn barrier(&mut self, name: &str, world_size: usize) -> Result<(), StoreError> {
        let world = world_size.max(1) as i64;
        let arrived = self.add(&format!("barrier/{name}/arrived"), 1)?;
        let generation = (arrived - 1) / world;
        let done = format!("barrier/{name}/done/{generation}");
        if arrived % world == 0 {
            self.set(&done, &[])?;
        }
        let timeout = self.timeout;
        self.call("barrier", GET, &done, &[], timeout).map(|_| ())
    }

    fn call(
        &mut self,
        op: &'static str,
        code: u8,
        key: &str,
        value: &[u8],
        timeout: Duration,
    ) -> Result<Vec<u8>, StoreError> {
        let addr = self.addr.clone();
        let io = |source| StoreError::Io {
            addr: addr.clone(),
            source,
        };
        if self.broken {
            return Err(io(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "the connection failed earlier; connect again",
            )));
        }
        let result = self.round_trip(code, key, value, timeout).map_err(io);
        self.broken = result.is_err();
        let (status, reply) = result?;
        match status {
            OK => Ok(reply),
            TIMED_OUT => Err(StoreError::Timeout {
                op,
                key: key.to_string(),
                after: timeout,
            }),
            _ => Err(StoreError::Refused {
                op,
                key: key.to_string(),
                reason: String::from_utf8_lossy(&reply).into_owned(),
            }),
        }
    }

    fn round_trip(
        &mut self,
        code: u8,
        key: &str,
        value: &[u8],
        timeout: Duration,
    ) -> io::Result<(u8, Vec<u8>)> {
        let millis = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        let mut frame = vec![code];
        frame.extend_from_slice(&millis.to_le_bytes());
        write_bytes(&mut frame, key.as_bytes())?;
        write_bytes(&mut frame, value)?;
        self.stream.write_all(&frame)?;
        // The server answers a timed-out wait itself; this only guards against a dead server.
        let guard = timeout.saturating_add(Duration::from_secs(30));
        self.stream
            .set_read_timeout(Some(guard.min(Duration::from_secs(86_400))))?;
        let mut status = [0u8; 1];
        self.stream.read_exact(&mut status)?;
        Ok((status[0], read_bytes(&mut self.stream, MAX_VALUE)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (StoreServer, impl Fn() -> Store) {
        let server = StoreServer::bind("127.0.0.1:0").unwrap();
        let addr = server.addr().to_string();
        (server, move || {
            Store::connect(&addr, Duration::from_secs(5)).unwrap()
        })
    }

    #[test]
    fn get_waits_for_a_later_set_and_add_counts() {
        let (_server, connect) = pair();
        let mut reader = connect();
        let mut writer = connect();
        let waiting = thread::spawn(move || reader.get("id").unwrap());
        thread::sleep(Duration::from_millis(50));
        writer.set("id", b"hello").unwrap();
        assert_eq!(waiting.join().unwrap(), b"hello");
        assert!(writer.check("id").unwrap());
        assert!(!writer.check("other").unwrap());
        assert_eq!(writer.add("n", 2).unwrap(), 2);
        assert_eq!(writer.add("n", -5).unwrap(), -3);
        let refused = writer.add("id", 1).unwrap_err().to_string();
        assert!(refused.contains("not a counter"), "{refused}");
    }

    #[test]
    fn the_server_waits_for_its_clients_to_hang_up_not_for_silent_connections() {
        let (server, connect) = pair();
        let silent = TcpStream::connect(server.addr()).unwrap();
        let mut client = connect();
        client.set("k", b"v").unwrap();
        assert!(!server.wait_for_clients_to_leave(Duration::from_millis(100)));
        let leaving = thread::spawn(move || {
            thread::sleep(Duration::from_millis(50));
            drop(client);
        });
        assert!(server.wait_for_clients_to_leave(Duration::from_secs(5)));
        leaving.join().unwrap();
        drop(silent);
    }

    #[test]
    fn barriers_and_timeouts() {
        let (server, connect) = pair();
        let ranks: Vec<_> = (0..4)
            .map(|_| {
                let mut store = connect();
                thread::spawn(move || store.barrier("start", 4))
            })
            .collect();
        for rank in ranks {
            rank.join().unwrap().unwrap();
        }
        let addr = server.addr().to_string();
        let mut lonely = Store::connect(&addr, Duration::from_millis(200)).unwrap();
        let started = Instant::now();
        let err = lonely.barrier("never", 2).unwrap_err();
        assert!(matches!(err, StoreError::Timeout { .. }), "{err}");
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(matches!(
            lonely.wait(&["missing"]),
            Err(StoreError::Timeout { .. })
        ));
    }

    #[test]
    fn a_barrier_name_can_be_used_again() {
        let (server, connect) = pair();
        let ranks: Vec<_> = (0..3)
            .map(|_| {
                let mut store = connect();
                thread::spawn(move || {
                    for _ in 0..5 {
                        store.barrier("step", 3)?;
                    }
                    Ok::<_, StoreError>(())
                })
            })
            .collect();
        for rank in ranks {
            rank.join().unwrap().unwrap();
        }
        // A fourth arrival is the start of a new round: alone, it waits and times out.
        let mut late =
            Store::connect(&server.addr().to_string(), Duration::from_millis(100)).unwrap();
        assert!(matches!(
            late.barrier("step", 3),
            Err(StoreError::Timeout { .. })
        ));
    }

    #[test]
    fn an_oversized_frame_closes_the_connection_without_allocating_it() {
        let (server, connect) = pair();
        let mut probe = TcpStream::connect(server.addr()).unwrap();
        probe.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        let mut answer = Vec::new();
        probe
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        assert_eq!(
            probe.read_to_end(&mut answer).unwrap(),
            0,
            "the server hung up"
        );
        let mut store = connect();
        let huge = vec![0u8; MAX_VALUE + 1];
        assert!(matches!(
            store.set("big", &huge),
            Err(StoreError::Io { .. })
        ));
        assert!(
            store.set("small", b"x").is_err(),
            "a failed connection stays failed"
        );
        assert!(
            !connect().check("big").unwrap(),
            "nothing of the oversized value was kept"
        );
    }

    #[test]
    fn connecting_to_nothing_fails_after_the_timeout() {
        let free = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let err = Store::connect(&free.to_string(), Duration::from_millis(200))
            .err()
            .unwrap();
        assert!(matches!(err, StoreError::Io { .. }), "{err}");
    }
}
