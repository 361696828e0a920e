//! The HTTP server: listeners from the host, hyper connections, routing, graceful shutdown.

use crate::{
    Config,
    api::{self, ApiError, Endpoint, Meta},
    bridge::{self, Event},
};
use abi_stable::std_types::RResult;
use bytes::Bytes;
use http_body::Frame;
use http_body_util::{BodyExt, Full, Limited, combinators::BoxBody};
use hyper::{
    Method, Request, Response, StatusCode,
    body::Incoming,
    header::{self, HeaderValue},
    server::conn::http1,
    service::service_fn,
};
use hyper_util::{
    rt::{TokioIo, TokioTimer},
    server::graceful::GracefulShutdown,
};
use serde_json::{Value, json};
use std::{
    convert::Infallible,
    os::fd::FromRawFd,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};
use tokio::{
    io::{AsyncRead, AsyncWrite},
    sync::{mpsc, watch},
};
use u_sdk::{EngineBox, HostBox, Listener, ShutdownBox, Transport, TransportContext, UError};

type Body = BoxBody<Bytes, Infallible>;

/// The transport object.
pub struct Http {
    pub(crate) host: HostBox,
    pub(crate) config: Config,
}

struct State {
    engine: EngineBox,
    config: Config,
    http: http1::Builder,
}

enum AnyListener {
    Tcp(tokio::net::TcpListener),
    Unix(tokio::net::UnixListener),
}

impl Transport for Http {
    fn serve(&self, context: TransportContext) -> RResult<(), UError> {
        u_sdk::guard("transport-http.serve", || self.run(context))
    }
}

impl Http {
    fn run(&self, context: TransportContext) -> Result<(), UError> {
        let TransportContext {
            engine,
            shutdown,
            listeners,
        } = context;
        if listeners.is_empty() {
            return Err(UError::invalid(
                "transport-http has no listeners: grant it `net.listen` addresses in the deployment",
            ));
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("transport-http")
            .enable_all()
            .build()
            .map_err(|e| UError::io("transport-http: starting the runtime", e))?;
        let mut bound = Vec::new();
        {
            let _inside = runtime.enter();
            for l in listeners.into_iter() {
                bound.push((l.address.to_string(), adopt(&l)?));
            }
        }
        let mut http = http1::Builder::new();
        http.keep_alive(true)
            .timer(TokioTimer::new())
            .header_read_timeout(Duration::from_millis(self.config.header_read_timeout_ms));
        let state = Arc::new(State {
            engine,
            config: self.config.clone(),
            http,
        });
        let host = self.host.clone();
        runtime.block_on(serve_all(host, state, bound, shutdown));
        runtime.shutdown_timeout(Duration::from_secs(1));
        Ok(())
    }
}

/// Takes ownership of a listening socket the host opened.
fn adopt(l: &Listener) -> Result<AnyListener, UError> {
    let address = l.address.as_str();
    let io = |e| UError::io(format!("transport-http: listener {address}"), e);
    if address.starts_with("unix:") {
        // SAFETY: the host hands the transport ownership of this listening socket.
        let std = unsafe { std::os::unix::net::UnixListener::from_raw_fd(l.fd) };
        std.set_nonblocking(true).map_err(io)?;
        Ok(AnyListener::Unix(
            tokio::net::UnixListener::from_std(std).map_err(io)?,
        ))
    } else {
        // SAFETY: as above.
        let std = unsafe { std::net::TcpListener::from_raw_fd(l.fd) };
        std.set_nonblocking(true).map_err(io)?;
        Ok(AnyListener::Tcp(
            tokio::net::TcpListener::from_std(std).map_err(io)?,
        ))
    }
}

async fn serve_all(
    host: HostBox,
    state: Arc<State>,
    listeners: Vec<(String, AnyListener)>,
    shutdown: ShutdownBox,
) {
    let (stop_tx, stop_rx) = watch::channel(false);
    // The host's shutdown signal blocks; poll it on a blocking thread.
    tokio::task::spawn_blocking(move || {
        while !shutdown.wait(200) {
            if stop_tx.is_closed() {
                return;
            }
        }
        let _ = stop_tx.send(true);
    });
    let graceful = Arc::new(GracefulShutdown::new());
    let mut tasks = Vec::new();
    for (address, listener) in listeners {
        host.info(&format!("transport-http: serving on {address}"));
        tasks.push(tokio::spawn(accept_loop(
            host.clone(),
            address,
            listener,
            state.clone(),
            graceful.clone(),
            stop_rx.clone(),
        )));
    }
    let mut stop = stop_rx;
    while !*stop.borrow() {
        if stop.changed().await.is_err() {
            break;
        }
    }
    for t in tasks {
        let _ = t.await;
    }
    let in_flight = graceful.count();
    host.info(&format!(
        "transport-http: shutting down; letting {in_flight} open connection(s) finish"
    ));
    let grace = Duration::from_millis(state.config.shutdown_grace_ms);
    if let Ok(graceful) = Arc::try_unwrap(graceful)
        && tokio::time::timeout(grace, graceful.shutdown())
            .await
            .is_err()
    {
        host.warn("transport-http: grace period over; dropping the remaining connections");
    }
}

async fn accept_loop(
    host: HostBox,
    address: String,
    listener: AnyListener,
    state: Arc<State>,
    graceful: Arc<GracefulShutdown>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        if *stop.borrow() {
            return;
        }
        let accepted = tokio::select! {
            changed = stop.changed() => {
                if changed.is_err() { return; }
                continue;
            }
            r = accept(&listener) => r,
        };
        match accepted {
            Ok(Accepted::Tcp(s)) => {
                let _ = s.set_nodelay(true);
                connection(s, &state, &graceful);
            }
            Ok(Accepted::Unix(s)) => connection(s, &state, &graceful),
            Err(e) => {
                // E.g. out of descriptors: back off instead of spinning.
                host.warn(&format!("transport-http: accept on {address}: {e}"));
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

enum Accepted {
    Tcp(tokio::net::TcpStream),
    Unix(tokio::net::UnixStream),
}

async fn accept(l: &AnyListener) -> std::io::Result<Accepted> {
    match l {
        AnyListener::Tcp(l) => l.accept().await.map(|(s, _)| Accepted::Tcp(s)),
        AnyListener::Unix(l) => l.accept().await.map(|(s, _)| Accepted::Unix(s)),
    }
}

fn connection<S>(stream: S, state: &Arc<State>, graceful: &GracefulShutdown)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let svc_state = state.clone();
    let service = service_fn(move |req| {
        let state = svc_state.clone();
        async move { Ok::<_, Infallible>(handle(state, req).await) }
    });
    let conn = state.http.serve_connection(TokioIo::new(stream), service);
    let watched = graceful.watch(conn);
    tokio::spawn(async move {
        // Connection errors (a client that vanished, timed-out headers) concern that client
        // only.
        let _ = watched.await;
    });
}

fn json_response(status: u16, value: &Value) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::from(value.to_string())).boxed());
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

fn error_response(e: &ApiError) -> Response<Body> {
    json_response(e.status, &e.body())
}

async fn handle(state: Arc<State>, req: Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    let models: Vec<String> = state
        .engine
        .models()
        .iter()
        .map(|m| m.to_string())
        .collect();
    let endpoint = match path.as_str() {
        "/v1/chat/completions" => Some(Endpoint::Chat),
        "/v1/completions" => Some(Endpoint::Completions),
        _ => None,
    };
    match (method, path.as_str(), endpoint) {
        (Method::GET, "/health", _) => {
            json_response(200, &json!({"status": "ok", "models": models}))
        }
        (Method::GET, "/v1/models", _) => json_response(
            200,
            &json!({"object": "list", "data": models.iter().map(|m| model_object(m)).collect::<Vec<_>>()}),
        ),
        (Method::GET, p, _) if p.starts_with("/v1/models/") => {
            let id = &p["/v1/models/".len()..];
            if models.iter().any(|m| m == id) {
                json_response(200, &model_object(id))
            } else {
                error_response(&ApiError::model_not_found(id))
            }
        }
        (Method::POST, _, Some(endpoint)) => match completion(&state, endpoint, req, &models).await
        {
            Ok(r) => r,
            Err(e) => error_response(&e),
        },
        (_, "/health" | "/v1/models", _) | (_, _, Some(_)) => {
            let mut r = error_response(&ApiError::status(
                405,
                "invalid_request_error",
                format!("{} does not allow this method", path),
            ));
            r.headers_mut().insert(
                header::ALLOW,
                HeaderValue::from_static(if endpoint.is_some() { "POST" } else { "GET" }),
            );
            r
        }
        _ => error_response(&ApiError::status(
            404,
            "invalid_request_error",
            format!("no endpoint {path}"),
        )),
    }
}

fn model_object(id: &str) -> Value {
    json!({"id": id, "object": "model", "created": 0, "owned_by": "u"})
}

async fn read_body(state: &State, req: Request<Incoming>) -> Result<Bytes, ApiError> {
    let max = state.config.max_body_bytes;
    let too_large = |n: Option<u64>| {
        ApiError::status(
            413,
            "invalid_request_error",
            match n {
                Some(n) => format!("the request body is {n} bytes; the limit is {max}"),
                None => format!("the request body exceeds the limit of {max} bytes"),
            },
        )
    };
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if let Some(n) = declared
        && n > max as u64
    {
        return Err(too_large(Some(n)));
    }
    let timeout = Duration::from_millis(state.config.body_read_timeout_ms);
    match tokio::time::timeout(timeout, Limited::new(req.into_body(), max).collect()).await {
        Err(_) => Err(ApiError::status(
            408,
            "invalid_request_error",
            "the request body did not arrive in time",
        )),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => Err(too_large(None)),
        Ok(Err(e)) => Err(ApiError::invalid(format!("reading the request body: {e}"))),
        Ok(Ok(collected)) => Ok(collected.to_bytes()),
    }
}

async fn completion(
    state: &State,
    endpoint: Endpoint,
    req: Request<Incoming>,
    models: &[String],
) -> Result<Response<Body>, ApiError> {
    let body = read_body(state, req).await?;
    let parsed = api::parse(endpoint, &body, models, state.config.default_max_tokens)?;
    let meta = Meta::new(endpoint, parsed.request.model.as_str());
    let mut events = bridge::start(state.engine.clone(), parsed.request);
    if !parsed.stream {
        let mut text = String::new();
        loop {
            match events.recv().await {
                Some(Event::Text(t)) => text.push_str(&t),
                Some(Event::Done(summary)) => {
                    return Ok(json_response(200, &meta.response(&text, &summary)));
                }
                Some(Event::Failed(e)) => return Err(ApiError::from_engine(&e)),
                None => {
                    return Err(ApiError::status(500, "server_error", "the engine stopped"));
                }
            }
        }
    }
    // Errors the engine finds before the first token (an empty prompt, a full context) are
    // still answered with a status; after that the stream has begun.
    let first = match events.recv().await {
        Some(Event::Failed(e)) => return Err(ApiError::from_engine(&e)),
        None => return Err(ApiError::status(500, "server_error", "the engine stopped")),
        Some(first) => first,
    };
    let (tx, rx) = mpsc::channel::<Bytes>(32);
    tokio::spawn(stream_events(meta, first, events, tx, parsed.include_usage));
    let mut r = Response::new(ChannelBody(rx).boxed());
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    Ok(r)
}

/// Turns engine events into SSE chunks. Returning early (the client went away) drops
/// `events`, which cancels the generation.
async fn stream_events(
    meta: Meta,
    first: Event,
    mut events: mpsc::Receiver<Event>,
    tx: mpsc::Sender<Bytes>,
    include_usage: bool,
) {
    let send = |s: String| {
        let tx = tx.clone();
        async move { tx.send(Bytes::from(s)).await.is_ok() }
    };
    let usage_null = include_usage.then_some(Value::Null);
    if meta.endpoint == Endpoint::Chat
        && !send(api::sse(&meta.chunk(
            Some(""),
            true,
            None,
            usage_null.clone(),
        )))
        .await
    {
        return;
    }
    let mut next = Some(first);
    loop {
        let event = match next.take() {
            Some(e) => Some(e),
            None => events.recv().await,
        };
        match event {
            Some(Event::Text(t)) => {
                if !send(api::sse(&meta.chunk(
                    Some(&t),
                    false,
                    None,
                    usage_null.clone(),
                )))
                .await
                {
                    return;
                }
            }
            Some(Event::Done(summary)) => {
                let text = (meta.endpoint == Endpoint::Completions).then_some("");
                let last = meta.chunk(text, false, Some(summary.finish), usage_null.clone());
                if !send(api::sse(&last)).await {
                    return;
                }
                if include_usage
                    && !send(api::sse(&meta.chunk(
                        None,
                        false,
                        None,
                        Some(api::usage(&summary)),
                    )))
                    .await
                {
                    return;
                }
                send(api::SSE_DONE.to_string()).await;
                return;
            }
            Some(Event::Failed(e)) => {
                send(api::sse(&ApiError::from_engine(&e).body())).await;
                return;
            }
            None => return,
        }
    }
}

/// A response body fed from a channel.
struct ChannelBody(mpsc::Receiver<Bytes>);

impl http_body::Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|b| b.map(|b| Ok(Frame::data(b))))
    }
}
