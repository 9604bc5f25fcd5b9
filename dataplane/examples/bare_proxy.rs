//! The floor of a proxy on this stack, for the benchmarks only (bench/bare_proxy.py, `bench.dataplane
//! --floor`): hyper on one current-thread tokio runtime, as the sidecar's front runs with
//! `listen.workers: 1`, passing every request through to Triton with no check, no parse of a body, no
//! counter and no log. What it reaches next to direct is what no proxy built on this stack (the sidecar
//! included) can beat on the same machine; the sidecar's own figures are read against it.
//!
//!     bare_proxy http1 LISTEN_PORT UPSTREAM_PORT    # HTTP/1.1, one upstream connection per client's
//!     bare_proxy h2c LISTEN_PORT UPSTREAM_PORT      # HTTP/2 cleartext (gRPC), one upstream connection
//!
//! Both sides set TCP_NODELAY, as the sidecar does. Never shipped: an example of the crate, built by
//! `cargo build --release --example bare_proxy` when a benchmark asks for it.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode, Uri};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Mutex;

type Reply = Response<BoxBody<Bytes, hyper::Error>>;

fn bad_gateway(e: impl std::fmt::Display) -> Reply {
    let body = Full::new(Bytes::from(format!("bare_proxy: {e}\n"))).map_err(|never| match never {}).boxed();
    let mut reply = Response::new(body);
    *reply.status_mut() = StatusCode::BAD_GATEWAY;
    reply
}

async fn upstream(port: u16) -> std::io::Result<TcpStream> {
    let stream = TcpStream::connect(SocketAddr::from(([127, 0, 0, 1], port))).await?;
    stream.set_nodelay(true)?;
    Ok(stream)
}

async fn serve_http1(client: TcpStream, port: u16) -> Result<(), Box<dyn std::error::Error>> {
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(upstream(port).await?)).await?;
    tokio::spawn(connection);
    // One request at a time on an HTTP/1.1 connection: the lock is never contended.
    let sender = Arc::new(Mutex::new(sender));
    let service = service_fn(move |request: Request<Incoming>| {
        let sender = sender.clone();
        async move {
            let reply = match sender.lock().await.send_request(request).await {
                Ok(answer) => answer.map(|body| body.boxed()),
                Err(e) => bad_gateway(e),
            };
            Ok::<_, Infallible>(reply)
        }
    });
    hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(client), service).await?;
    Ok(())
}

async fn serve_h2c(client: TcpStream, port: u16) -> Result<(), Box<dyn std::error::Error>> {
    let (sender, connection) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(upstream(port).await?)).await?;
    tokio::spawn(connection);
    let service = service_fn(move |mut request: Request<Incoming>| {
        let mut sender = sender.clone();
        async move {
            // h2 needs a scheme and an authority on the way out; the client's path is kept.
            let path = request.uri().path_and_query().map(|p| p.as_str()).unwrap_or("/").to_string();
            let reply = match format!("http://127.0.0.1:{port}{path}").parse::<Uri>() {
                Ok(uri) => {
                    *request.uri_mut() = uri;
                    match sender.send_request(request).await {
                        Ok(answer) => answer.map(|body| body.boxed()),
                        Err(e) => bad_gateway(e),
                    }
                }
                Err(e) => bad_gateway(e),
            };
            Ok::<_, Infallible>(reply)
        }
    });
    hyper::server::conn::http2::Builder::new(TokioExecutor::new())
        .serve_connection(TokioIo::new(client), service)
        .await?;
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let (mode, listen, port) = match args.as_slice() {
        [_, mode, listen, port] if mode == "http1" || mode == "h2c" => {
            (mode.clone(), listen.parse::<u16>()?, port.parse::<u16>()?)
        }
        _ => return Err("usage: bare_proxy http1|h2c LISTEN_PORT UPSTREAM_PORT".into()),
    };
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async move {
        let listener = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], listen))).await?;
        loop {
            let (client, _) = listener.accept().await?;
            client.set_nodelay(true)?;
            let h2 = mode == "h2c";
            tokio::spawn(async move {
                let served = if h2 { serve_h2c(client, port).await } else { serve_http1(client, port).await };
                if let Err(e) = served {
                    eprintln!("bare_proxy: a connection ended: {e}");
                }
            });
        }
    })
}
