//! A real TCP server on loopback (in-process engine, real model) and a line client for the server tests.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arbor_actors::server::{BackgroundServer, ServerConfig};
use arbor_actors::{DrafterFactory, Engine, EngineConfig};
use serde_json::{json, Value};

use crate::common;

pub struct TestServer {
    pub addr: SocketAddr,
    pub engine: Arc<Engine>,
    server: BackgroundServer,
}

/// smollm2 with a small pool; `drafters`: engine drafters (calibrates the step cost).
pub fn engine_config(drafters: Vec<DrafterFactory>) -> EngineConfig {
    let (model, tok) = common::smollm2_shared();
    let mut c = EngineConfig::new(model, tok);
    c.threads = 0;
    c.kv_memory = Some(48 << 20);
    c.drafters = drafters;
    c
}

impl TestServer {
    pub fn start(config: EngineConfig, server_config: ServerConfig) -> TestServer {
        let engine = Arc::new(Engine::start(config).expect("engine starts"));
        let server = BackgroundServer::start(Arc::clone(&engine), "127.0.0.1:0", server_config)
            .expect("server starts");
        TestServer {
            addr: server.addr,
            engine,
            server,
        }
    }

    pub fn plain() -> TestServer {
        TestServer::start(engine_config(vec![]), ServerConfig::default())
    }

    pub fn client(&self) -> Client {
        Client::connect(self.addr)
    }

    /// Signal shutdown (as SIGTERM does) and wait until the server has stopped.
    pub fn shutdown(&mut self) {
        self.server.shutdown().expect("server stops cleanly");
    }

    /// Signal shutdown without waiting.
    pub fn signal_shutdown(&mut self) {
        self.server.signal_shutdown();
    }

    /// Poll `stats` until `pred` holds (or panic after 30 s).
    pub fn wait_stats(&self, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        let mut c = self.client();
        let t0 = Instant::now();
        loop {
            let s = c.stats();
            if pred(&s) {
                return s;
            }
            assert!(t0.elapsed() < Duration::from_secs(30), "{what}: stats {s}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

pub struct Client {
    pub r: BufReader<TcpStream>,
    pub w: TcpStream,
}

impl Client {
    pub fn connect(addr: SocketAddr) -> Client {
        let w = TcpStream::connect(addr).expect("connect");
        w.set_read_timeout(Some(Duration::from_secs(120)))
            .expect("timeout");
        let r = BufReader::new(w.try_clone().expect("clone"));
        Client { r, w }
    }

    pub fn send_raw(&mut self, bytes: &[u8]) {
        self.w.write_all(bytes).expect("write");
    }

    pub fn send(&mut self, v: &Value) {
        let mut s = v.to_string();
        s.push('\n');
        self.send_raw(s.as_bytes());
    }

    /// The next line, parsed (panics on EOF or invalid JSON from the server).
    pub fn recv(&mut self) -> Value {
        let mut line = String::new();
        let n = self.r.read_line(&mut line).expect("read");
        assert!(n > 0, "server closed the connection");
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("bad line {line:?}: {e}"))
    }

    /// The next line, or `None` at EOF.
    pub fn try_recv(&mut self) -> Option<Value> {
        let mut line = String::new();
        match self.r.read_line(&mut line) {
            Ok(0) | Err(_) => None,
            Ok(_) => serde_json::from_str(&line).ok(),
        }
    }

    pub fn stats(&mut self) -> Value {
        self.send(&json!({"stats": true}));
        loop {
            let v = self.recv();
            if let Some(s) = v.get("stats") {
                return s.clone();
            }
        }
    }

    /// Send one request and read until its final line: (token events, final line).
    pub fn run(&mut self, req: &Value) -> (Vec<Value>, Value) {
        self.send(req);
        let id = req["id"].clone();
        let mut events = Vec::new();
        loop {
            let v = self.recv();
            assert_eq!(v["id"], id, "a line for another request: {v}");
            if v.get("done").is_some() || v.get("error").is_some() {
                return (events, v);
            }
            events.push(v);
        }
    }
}

/// Concatenated text and tokens of streamed events.
pub fn streamed(events: &[Value]) -> (String, Vec<u32>) {
    let mut text = String::new();
    let mut toks = Vec::new();
    for e in events {
        text.push_str(e["text"].as_str().expect("text"));
        for t in e["tokens"].as_array().expect("tokens") {
            toks.push(t.as_u64().expect("token id") as u32);
        }
    }
    (text, toks)
}

pub fn code(v: &Value) -> &str {
    v["error"]["code"].as_str().unwrap_or("")
}
