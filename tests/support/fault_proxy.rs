//! A userspace TCP proxy that makes a link slow, stalled or cut (the kernel here has no
//! `netem`): every chunk waits the set delay before it is passed on, at most at the set
//! rate; a stall holds all bytes in both directions while the connections stay open; a cut
//! closes every connection at once, in the middle of whatever was on its way. One thread per direction per connection;
//! everything stops when the proxy is dropped.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Default)]
struct Faults {
    delay_ms: AtomicU64,
    /// Bytes a second each direction of a connection may carry (0: no cap).
    rate: AtomicU64,
    stalled: AtomicBool,
    stopped: AtomicBool,
    /// Bytes passed on from the target to the clients.
    to_clients: AtomicU64,
    /// Both ends of every open connection, to cut them.
    open: Mutex<Vec<TcpStream>>,
}

/// A running proxy to one target.
pub struct FaultProxy {
    /// The port devices connect to (loopback).
    pub port: u16,
    faults: Arc<Faults>,
}

impl FaultProxy {
    /// Listens on a free loopback port and forwards each connection to `target`.
    pub fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        let port = listener.local_addr().expect("proxy address").port();
        listener.set_nonblocking(true).expect("nonblocking");
        let faults = Arc::new(Faults::default());
        let shared = faults.clone();
        std::thread::spawn(move || {
            while !shared.stopped.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((client, _)) => {
                        let _ = client.set_nonblocking(false);
                        if let Ok(server) = TcpStream::connect(target) {
                            connect(&shared, client, server);
                        }
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Self { port, faults }
    }

    /// Each chunk waits `delay` before it is passed on, in each direction.
    pub fn set_delay(&self, delay: Duration) {
        self.faults
            .delay_ms
            .store(delay.as_millis() as u64, Ordering::Relaxed);
    }

    /// Caps each direction of each connection at `bytes_per_second` (0 lifts the cap).
    pub fn set_rate(&self, bytes_per_second: u64) {
        self.faults.rate.store(bytes_per_second, Ordering::Relaxed);
    }

    /// Holds (or releases) every byte in both directions; connections stay open.
    pub fn set_stalled(&self, stalled: bool) {
        self.faults.stalled.store(stalled, Ordering::Relaxed);
    }

    /// Bytes passed on from the target to the clients so far.
    pub fn bytes_to_clients(&self) -> u64 {
        self.faults.to_clients.load(Ordering::Relaxed)
    }

    /// Closes every open connection at once.
    pub fn cut(&self) {
        let open = std::mem::take(&mut *self.faults.open.lock().expect("proxy connections"));
        for stream in open {
            let _ = stream.shutdown(Shutdown::Both);
        }
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.faults.stopped.store(true, Ordering::Relaxed);
        self.cut();
    }
}

fn connect(faults: &Arc<Faults>, client: TcpStream, server: TcpStream) {
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let clones = [client.try_clone(), server.try_clone()];
    let [Ok(client_copy), Ok(server_copy)] = clones else {
        return;
    };
    if let Ok(mut open) = faults.open.lock() {
        open.extend(
            [client.try_clone(), server.try_clone()]
                .into_iter()
                .flatten(),
        );
    }
    for (from, to, to_client) in [(client, server_copy, false), (server, client_copy, true)] {
        let faults = faults.clone();
        std::thread::spawn(move || pump(&faults, from, to, to_client));
    }
}

/// Copies `from` to `to` with the proxy's faults until either end closes: a reader takes
/// each chunk as it comes, a writer passes it on once it is `delay` old (so the delay is
/// latency, not a cap on throughput) and while no stall holds it.
fn pump(faults: &Arc<Faults>, mut from: TcpStream, to: TcpStream, to_client: bool) {
    let (chunks, arriving) = std::sync::mpsc::channel::<(std::time::Instant, Vec<u8>)>();
    let writer = {
        let faults = faults.clone();
        let mut to = to.try_clone().expect("clone the stream");
        std::thread::spawn(move || {
            for (read_at, chunk) in arriving {
                let delay = Duration::from_millis(faults.delay_ms.load(Ordering::Relaxed));
                if let Some(wait) =
                    (read_at + delay).checked_duration_since(std::time::Instant::now())
                {
                    std::thread::sleep(wait);
                }
                while faults.stalled.load(Ordering::Relaxed)
                    && !faults.stopped.load(Ordering::Relaxed)
                {
                    std::thread::sleep(Duration::from_millis(10));
                }
                if to.write_all(&chunk).is_err() {
                    break;
                }
                if to_client {
                    faults
                        .to_clients
                        .fetch_add(chunk.len() as u64, Ordering::Relaxed);
                }
                let rate = faults.rate.load(Ordering::Relaxed);
                if rate > 0 {
                    std::thread::sleep(Duration::from_secs_f64(chunk.len() as f64 / rate as f64));
                }
            }
            let _ = to.shutdown(Shutdown::Both);
        })
    };
    let mut buffer = [0u8; 16 * 1024];
    loop {
        let read = match from.read(&mut buffer) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if chunks
            .send((std::time::Instant::now(), buffer[..read].to_vec()))
            .is_err()
        {
            break;
        }
    }
    drop(chunks);
    let _ = writer.join();
    let _ = to.shutdown(Shutdown::Both);
    let _ = from.shutdown(Shutdown::Both);
}
