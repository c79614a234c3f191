//! The torchrun environment: how a process started by `burn-launch` (or torchrun, or a cluster
//! scheduler that sets the same variables) learns its place in the job.

use std::env;
use std::time::Duration;

use crate::CommError;
use crate::store::{Store, StoreError, StoreServer};

/// This process's place in a multi-process job, from `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
/// `LOCAL_WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessEnv {
    /// Rank of this process in the job.
    pub rank: usize,
    /// Processes in the job.
    pub world_size: usize,
    /// Rank of this process on its machine (which GPU it drives).
    pub local_rank: usize,
    /// Processes on this machine.
    pub local_world_size: usize,
    /// Host of rank 0's store.
    pub master_addr: String,
    /// Port of rank 0's store.
    pub master_port: u16,
}

impl ProcessEnv {
    /// Reads the variables; a missing or malformed one is an error that names it.
    pub fn from_env() -> Result<Self, CommError> {
        Self::from_lookup(|name| env::var(name).ok())
    }

    /// Reads the variables from `lookup` (for tests and for other launchers' conventions).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, CommError> {
        let number = |name: &str| -> Result<usize, CommError> {
            let value = lookup(name).ok_or_else(|| {
                CommError::Config(format!(
                    "{name} is not set; start the program with burn-launch (or torchrun), which sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT"
                ))
            })?;
            value.trim().parse().map_err(|_| {
                CommError::Config(format!("{name}={value} is not a non-negative integer"))
            })
        };
        let world_size = number("WORLD_SIZE")?;
        let rank = number("RANK")?;
        let local_world_size = number("LOCAL_WORLD_SIZE")?;
        let local_rank = number("LOCAL_RANK")?;
        let master_addr = lookup("MASTER_ADDR").ok_or_else(|| {
            CommError::Config("MASTER_ADDR is not set; it names the host of rank 0".into())
        })?;
        let port = number("MASTER_PORT")?;
        if world_size == 0 || rank >= world_size {
            return Err(CommError::Config(format!(
                "RANK={rank} is not below WORLD_SIZE={world_size}"
            )));
        }
        if local_world_size == 0 || local_rank >= local_world_size || local_world_size > world_size
        {
            return Err(CommError::Config(format!(
                "LOCAL_RANK={local_rank} must be below LOCAL_WORLD_SIZE={local_world_size}, itself at most WORLD_SIZE={world_size}"
            )));
        }
        let master_port = u16::try_from(port).ok().filter(|&p| p > 0).ok_or_else(|| {
            CommError::Config(format!("MASTER_PORT={port} is not a port (1-65535)"))
        })?;
        Ok(Self {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
        })
    }

    /// The variables [`ProcessEnv::from_env`] reads, as a launcher sets them for this process.
    pub fn vars(&self) -> [(&'static str, String); 6] {
        [
            ("RANK", self.rank.to_string()),
            ("WORLD_SIZE", self.world_size.to_string()),
            ("LOCAL_RANK", self.local_rank.to_string()),
            ("LOCAL_WORLD_SIZE", self.local_world_size.to_string()),
            ("MASTER_ADDR", self.master_addr.clone()),
            ("MASTER_PORT", self.master_port.to_string()),
        ]
    }

    /// Rank `rank` of a job of `world_size` processes on this machine alone, meeting at
    /// `127.0.0.1:port`.
    pub fn on_this_machine(rank: usize, world_size: usize, port: u16) -> Self {
        Self {
            rank,
            world_size,
            local_rank: rank,
            local_world_size: world_size,
            master_addr: "127.0.0.1".to_string(),
            master_port: port,
        }
    }

    /// `MASTER_ADDR:MASTER_PORT`.
    pub fn master(&self) -> String {
        format!("{}:{}", self.master_addr, self.master_port)
    }

    /// Rendezvous: rank 0 serves the store on `MASTER_PORT` (on every interface), every rank
    /// connects to `MASTER_ADDR`, and all meet at a barrier, so on return the whole job is up.
    /// `timeout` bounds each wait (the connection, the barrier, every later store call). End
    /// with [`Rendezvous::depart`], so rank 0 keeps the store until everyone is done with it.
    pub fn rendezvous(&self, timeout: Duration) -> Result<Rendezvous, StoreError> {
        let server = if self.rank == 0 {
            let bound = StoreServer::bind(("0.0.0.0", self.master_port)).map_err(|source| {
                StoreError::Io {
                    addr: format!("0.0.0.0:{}", self.master_port),
                    source,
                }
            })?;
            Some(bound)
        } else {
            None
        };
        let mut store = Store::connect(&self.master(), timeout)?;
        store.barrier("rendezvous", self.world_size)?;
        Ok(Rendezvous { server, store })
    }
}

/// A job's meeting point: the store every rank is connected to, and on rank 0 its server.
pub struct Rendezvous {
    server: Option<StoreServer>,
    /// This rank's connection.
    pub store: Store,
}

impl Rendezvous {
    /// Leaves the job: every rank hangs up, and rank 0 (which serves the store) returns only
    /// once all have, so no rank loses the store in the middle of a call.
    pub fn depart(self) -> Result<(), StoreError> {
        let Self { server, store } = self;
        let timeout = store.timeout();
        let addr = store.addr().to_string();
        drop(store);
        match server {
            Some(server) if !server.wait_for_clients_to_leave(timeout) => {
                Err(StoreError::Timeout {
                    op: "depart",
                    key: format!("the clients of {addr}"),
                    after: timeout,
                })
            }
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let pairs: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| {
            pairs
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        }
    }

    const GOOD: [(&str, &str); 6] = [
        ("RANK", "3"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "2"),
        ("MASTER_ADDR", "10.0.0.1"),
        ("MASTER_PORT", "29500"),
    ];

    #[test]
    fn reads_the_torchrun_variables_and_names_bad_ones() {
        let parsed = ProcessEnv::from_lookup(env(&GOOD)).unwrap();
        // What a launcher sets reads back as it was.
        let vars = parsed.vars();
        let pairs: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (*k, v.as_str())).collect();
        assert_eq!(ProcessEnv::from_lookup(env(&pairs)).unwrap(), parsed);
        assert_eq!(parsed.rank, 3);
        assert_eq!(parsed.master(), "10.0.0.1:29500");
        let with = |key: &str, value: &str| {
            let mut pairs = GOOD.to_vec();
            pairs.retain(|(k, _)| *k != key);
            if !value.is_empty() {
                pairs.push((key, value));
            }
            ProcessEnv::from_lookup(env(&pairs))
                .unwrap_err()
                .to_string()
        };
        assert!(with("RANK", "").contains("RANK is not set"));
        assert!(with("RANK", "4").contains("not below WORLD_SIZE=4"));
        assert!(with("WORLD_SIZE", "two").contains("WORLD_SIZE=two"));
        assert!(with("LOCAL_RANK", "2").contains("LOCAL_RANK=2"));
        assert!(with("MASTER_PORT", "70000").contains("not a port"));
    }

    #[test]
    fn rank_0_departs_only_after_every_rank_has_hung_up() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
            .to_string();
        let rank = |r: &str| {
            let mut pairs = GOOD.to_vec();
            pairs.retain(|(k, _)| !matches!(*k, "RANK" | "MASTER_ADDR" | "MASTER_PORT"));
            pairs.extend([("RANK", r), ("MASTER_ADDR", "127.0.0.1")]);
            pairs.push(("MASTER_PORT", port.as_str()));
            ProcessEnv::from_lookup(env(&pairs)).unwrap()
        };
        let ranks: Vec<ProcessEnv> = ["0", "1", "2", "3"].into_iter().map(rank).collect();
        let slow_done = std::sync::Arc::new(std::sync::Mutex::new(None));
        let threads: Vec<_> = ranks
            .into_iter()
            .map(|env| {
                let slow_done = slow_done.clone();
                std::thread::spawn(move || {
                    let mut job = env.rendezvous(Duration::from_secs(10)).unwrap();
                    if env.rank == 3 {
                        std::thread::sleep(Duration::from_millis(200));
                        job.store.set("late", b"x").unwrap();
                        *slow_done.lock().unwrap() = Some(std::time::Instant::now());
                    }
                    job.depart().unwrap();
                    std::time::Instant::now()
                })
            })
            .collect();
        let departed: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        let slow_done = slow_done.lock().unwrap().expect("rank 3 finished its call");
        assert!(
            departed[0] >= slow_done,
            "rank 0 left before rank 3's last call"
        );
    }
}
