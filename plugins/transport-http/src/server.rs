//! The HTTP server: listeners from the host, hyper connections, routing, graceful shutdown.

use crate::{
    Config, access, anthropic,
    bridge::{self, Event},
    checkpoints, choices,
    error::{ApiError, Dialect},
    metrics::Metrics,
    openai::{self, Endpoint},
    reply::Reply,
    safebox::{self, Verifier},
    sglang, tokens,
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
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};
use tokio::{
    io::{AsyncRead, AsyncWrite},
    sync::{mpsc, watch},
};
use u_sdk::{
    CheckpointOp, CheckpointRequest, EngineBox, GenerateRequest, GenerateSummary, HostBox,
    Listener, ShutdownBox, Transport, TransportContext, UError,
};

type Body = BoxBody<Bytes, Infallible>;

/// The transport object.
pub struct Http {
    pub(crate) host: HostBox,
    pub(crate) config: Config,
    pub(crate) secrets: Option<safebox::Secrets>,
    pub(crate) keys: Option<access::Keys>,
}

struct State {
    host: HostBox,
    engine: EngineBox,
    config: Config,
    http: http1::Builder,
    metrics: Metrics,
    verifier: Option<Verifier>,
    keys: Option<access::Keys>,
    cors: access::Cors,
    /// Clients in the admin scope (`admin_clients`).
    admins: Vec<String>,
    /// Every client identity the keys name (`key:NAME`, `hmac:ID`), to say whose an admin's
    /// listed checkpoints are.
    clients: Vec<String>,
}

enum AnyListener {
    Tcp(tokio::net::TcpListener),
    Unix(tokio::net::UnixListener),
}

impl Transport for Http {
    fn serve(&self, context: TransportContext) -> RResult<(), UError> {
        self.run(context).into()
    }
}

impl Http {
    /// Every client identity the configured keys name: `key:NAME` and `hmac:ID`.
    pub(crate) fn clients(&self) -> Vec<String> {
        let keys = self
            .keys
            .iter()
            .flat_map(|k| k.names())
            .map(|n| format!("key:{n}"));
        let hmac = match &self.secrets {
            Some(safebox::Secrets::Named(named)) => {
                named.iter().map(|(id, _)| format!("hmac:{id}")).collect()
            }
            _ => Vec::new(),
        };
        keys.chain(hmac).collect()
    }

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
        let verifier = match &self.secrets {
            Some(secrets) => Some(
                Verifier::new(secrets.clone(), self.config.hmac_window_s)
                    .map_err(|e| UError::invalid(format!("transport-http: {e}")))?,
            ),
            None => None,
        };
        let state = Arc::new(State {
            host: self.host.clone(),
            engine,
            config: self.config.clone(),
            http,
            metrics: Metrics::default(),
            verifier,
            keys: self.keys.clone(),
            cors: access::Cors {
                origins: self.config.cors_allow_origins.clone(),
            },
            admins: self.config.admin_clients.clone(),
            clients: self.clients(),
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
                let peer = s
                    .peer_addr()
                    .map_or("tcp".into(), |a| format!("tcp:{}", a.ip()));
                connection(s, peer.into(), &state, &graceful);
            }
            Ok(Accepted::Unix(s)) => {
                let peer = s
                    .peer_cred()
                    .map_or("unix".into(), |c| format!("unix:uid={}", c.uid()));
                connection(s, peer.into(), &state, &graceful)
            }
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

/// Serves one connection; `peer` (the client's address or Unix credentials) is the
/// fair-queueing key of its requests unless a request names its user.
fn connection<S>(stream: S, peer: Arc<str>, state: &Arc<State>, graceful: &GracefulShutdown)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let svc_state = state.clone();
    let service = service_fn(move |req| {
        let (state, peer) = (svc_state.clone(), peer.clone());
        async move { Ok::<_, Infallible>(handle(state, &peer, req).await) }
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

/// The built-in chat page (`GET /`): one self-contained HTML file compiled into the plugin, its
/// content security policy allowing no source but its own inline code and requests back to
/// this server (no CDN, nothing sent elsewhere). The page itself needs no API key; its requests
/// carry the one typed into it.
fn chat_page() -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::from_static(CHAT_PAGE.as_bytes())).boxed());
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
             connect-src 'self'; img-src 'self'; form-action 'none'; frame-ancestors 'none'",
        ),
    );
    r
}

/// The chat page's source.
const CHAT_PAGE: &str = include_str!("../assets/chat.html");

fn error_response(e: &ApiError, dialect: Dialect) -> Response<Body> {
    let mut r = json_response(e.status, &e.body(dialect));
    if let Some(s) = e.retry_after {
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(s));
    }
    r
}

/// What a request is, for routing, metrics labels and error shapes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Route {
    ChatPage,
    Health,
    Metrics,
    Models,
    Model,
    Chat,
    Completions,
    Messages,
    CountTokens,
    MessagesOther,
    Tokenize,
    Detokenize,
    Safebox,
    Embeddings,
    Checkpoints,
    CheckpointFork,
    CheckpointGraft,
    Checkpoint,
    SglGenerate,
    SglModelInfo,
    SglFlushCache,
    LoadAdapter,
    UnloadAdapter,
    Transcriptions,
    Translations,
    ImageGenerations,
    ImageVariations,
    Unknown,
}

impl Route {
    fn of(path: &str) -> Route {
        match path {
            "/" => Route::ChatPage,
            "/health" => Route::Health,
            "/metrics" => Route::Metrics,
            "/v1/models" => Route::Models,
            "/v1/chat/completions" => Route::Chat,
            "/v1/completions" => Route::Completions,
            "/v1/messages" => Route::Messages,
            "/v1/messages/count_tokens" => Route::CountTokens,
            "/tokenize" => Route::Tokenize,
            "/detokenize" => Route::Detokenize,
            safebox::PATH => Route::Safebox,
            "/v1/embeddings" => Route::Embeddings,
            "/v1/checkpoints" => Route::Checkpoints,
            "/v1/checkpoints/fork" => Route::CheckpointFork,
            "/v1/checkpoints/graft" => Route::CheckpointGraft,
            "/generate" => Route::SglGenerate,
            "/get_model_info" => Route::SglModelInfo,
            "/flush_cache" => Route::SglFlushCache,
            "/v1/load_lora_adapter" => Route::LoadAdapter,
            "/v1/unload_lora_adapter" => Route::UnloadAdapter,
            "/v1/audio/transcriptions" => Route::Transcriptions,
            "/v1/audio/translations" => Route::Translations,
            "/v1/images/generations" => Route::ImageGenerations,
            "/v1/images/variations" => Route::ImageVariations,
            p if p.starts_with("/v1/models/") => Route::Model,
            p if p.starts_with("/v1/messages/") => Route::MessagesOther,
            p if p.starts_with("/v1/checkpoints/") => Route::Checkpoint,
            _ => Route::Unknown,
        }
    }

    /// The metrics label: the route's pattern, never the raw path.
    fn label(self) -> &'static str {
        match self {
            Route::ChatPage => "/",
            Route::Health => "/health",
            Route::Metrics => "/metrics",
            Route::Models => "/v1/models",
            Route::Model => "/v1/models/{id}",
            Route::Chat => "/v1/chat/completions",
            Route::Completions => "/v1/completions",
            Route::Messages => "/v1/messages",
            Route::CountTokens => "/v1/messages/count_tokens",
            Route::MessagesOther => "/v1/messages/other",
            Route::Tokenize => "/tokenize",
            Route::Detokenize => "/detokenize",
            Route::Safebox => safebox::PATH,
            Route::Embeddings => "/v1/embeddings",
            Route::Checkpoints => "/v1/checkpoints",
            Route::CheckpointFork => "/v1/checkpoints/fork",
            Route::CheckpointGraft => "/v1/checkpoints/graft",
            Route::Checkpoint => "/v1/checkpoints/{name}",
            Route::SglGenerate => "/generate",
            Route::SglModelInfo => "/get_model_info",
            Route::SglFlushCache => "/flush_cache",
            Route::LoadAdapter => "/v1/load_lora_adapter",
            Route::UnloadAdapter => "/v1/unload_lora_adapter",
            Route::Transcriptions => "/v1/audio/transcriptions",
            Route::Translations => "/v1/audio/translations",
            Route::ImageGenerations => "/v1/images/generations",
            Route::ImageVariations => "/v1/images/variations",
            Route::Unknown => "other",
        }
    }

    fn dialect(self) -> Dialect {
        match self {
            Route::Messages | Route::CountTokens | Route::MessagesOther => Dialect::Anthropic,
            Route::Safebox => Dialect::Safebox,
            _ => Dialect::OpenAi,
        }
    }

    /// The methods the route answers.
    fn allows(self) -> &'static [Method] {
        match self {
            Route::ChatPage
            | Route::Health
            | Route::Metrics
            | Route::Models
            | Route::Model
            | Route::SglModelInfo => &[Method::GET],
            Route::Checkpoints => &[Method::GET, Method::POST],
            Route::Checkpoint => &[Method::DELETE],
            Route::Unknown | Route::MessagesOther => &[],
            _ => &[Method::POST],
        }
    }
}

/// How a handler answered: a response, whether its metrics and log line are still to be
/// recorded (a stream records them when it ends), and the tokens of a generation.
struct Answered {
    response: Response<Body>,
    recorded: bool,
    usage: Option<Usage>,
}

impl From<Response<Body>> for Answered {
    fn from(response: Response<Body>) -> Self {
        Self {
            response,
            recorded: false,
            usage: None,
        }
    }
}

/// A request as its log line names it.
#[derive(Clone)]
struct Line {
    method: Method,
    path: String,
    arrived: Instant,
}

/// The tokens of one generation: prompt, of which cached, and generated.
#[derive(Clone, Copy)]
struct Usage {
    prompt: u32,
    cached: u32,
    generated: u32,
}

impl Usage {
    fn of(s: &GenerateSummary) -> Self {
        Self {
            prompt: s.prompt_tokens,
            cached: s.cached_tokens,
            generated: s.generated_tokens,
        }
    }
}

impl State {
    /// Records a finished request in the metrics and logs its line at info level: method,
    /// path, status, tokens in (cached) and out when it generated, milliseconds.
    fn finished(&self, route: Route, line: &Line, status: u16, usage: Option<Usage>) {
        let took = line.arrived.elapsed();
        self.metrics.request(route.label(), status, took);
        let tokens = usage
            .map(|u| format!(" in={} cached={} out={}", u.prompt, u.cached, u.generated))
            .unwrap_or_default();
        self.host.info(&format!(
            "{} {} {status}{tokens} {}ms",
            line.method,
            line.path,
            took.as_millis()
        ));
    }
}

async fn handle(state: Arc<State>, peer: &str, req: Request<Incoming>) -> Response<Body> {
    let line = Line {
        method: req.method().clone(),
        path: req.uri().path().to_string(),
        arrived: Instant::now(),
    };
    let route = Route::of(req.uri().path());
    let cors = state.cors.check(req.headers());
    let answered = match &cors {
        Err(e) => Ok(error_response(e, route.dialect()).into()),
        Ok(access::Verdict::Allowed(origin)) if req.method() == Method::OPTIONS => {
            let mut r = Response::new(Full::new(Bytes::new()).boxed());
            *r.status_mut() = StatusCode::NO_CONTENT;
            access::allow(r.headers_mut(), origin.clone(), Some(route.allows()));
            Ok(r.into())
        }
        Ok(_) => dispatch(&state, peer, route, req, &line).await,
    };
    let mut answered = match answered {
        Ok(a) => a,
        Err(e) => error_response(&e, route.dialect()).into(),
    };
    if let Ok(access::Verdict::Allowed(origin)) = cors {
        access::allow(answered.response.headers_mut(), origin, None);
    }
    if !answered.recorded {
        let status = answered.response.status().as_u16();
        state.finished(route, &line, status, answered.usage);
    }
    answered.response
}

async fn dispatch(
    state: &Arc<State>,
    peer: &str,
    route: Route,
    req: Request<Incoming>,
    line: &Line,
) -> Result<Answered, ApiError> {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let path_and_query = req
        .uri()
        .path_and_query()
        .map_or(path.clone(), |p| p.as_str().to_string());
    let query = req.uri().query().map(str::to_string);
    if matches!(route, Route::Unknown | Route::MessagesOther) {
        return Err(ApiError::status(
            404,
            "invalid_request_error",
            format!("no endpoint {path}"),
        ));
    }
    if !route.allows().contains(&method) {
        let allow: Vec<&str> = route.allows().iter().map(Method::as_str).collect();
        let mut r = error_response(
            &ApiError::status(
                405,
                "invalid_request_error",
                format!("{path} does not allow {method}"),
            ),
            route.dialect(),
        );
        if let Ok(v) = HeaderValue::from_str(&allow.join(", ")) {
            r.headers_mut().insert(header::ALLOW, v);
        }
        return Ok(r.into());
    }
    let key = match (&state.keys, route) {
        (Some(keys), r) if r != Route::Health && r != Route::ChatPage => {
            Some(format!("key:{}", keys.check(req.headers())?))
        }
        _ => None,
    };
    let signed = signature_headers(req.headers());
    let content_type = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let limit = match route {
        Route::Transcriptions | Route::Translations => state.config.max_audio_bytes,
        _ => state.config.max_body_bytes,
    };
    let body = read_body(state, req, limit).await?;
    let mut hmac_id = None;
    if let Some(v) = &state.verifier {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        let headers = safebox::Signed {
            timestamp: signed[0].as_deref(),
            nonce: signed[1].as_deref(),
            signature: signed[2].as_deref(),
            key_id: signed[3].as_deref(),
        };
        hmac_id = v
            .check(method.as_str(), &path_and_query, &headers, &body, now)?
            .map(|id| format!("hmac:{id}"));
    }
    // The client: a named HMAC key's id, else an API key's name, else the connection's peer.
    // Checkpoints belong to a client the server can tell apart (either key, or a Unix peer's
    // uid); unauthenticated TCP clients and holders of one shared secret share one namespace.
    let keyed = hmac_id.is_some() || key.is_some();
    let peer = hmac_id.as_deref().or(key.as_deref()).unwrap_or(peer);
    let owner = if keyed || peer.starts_with("unix:") {
        peer
    } else {
        ""
    };
    let admin = !owner.is_empty() && state.admins.iter().any(|a| a == owner);
    let engine_error = |e: UError| ApiError::from_engine(&e);
    let models: Vec<String> = state
        .engine
        .models()
        .into_result()
        .map_err(engine_error)?
        .iter()
        .map(|m| m.to_string())
        .collect();
    let max = state.config.default_max_tokens;
    match route {
        Route::ChatPage => Ok(chat_page().into()),
        Route::Health => {
            let stats = state.engine.stats().into_result().map_err(engine_error)?;
            Ok(json_response(
                200,
                &json!({"status": "ok", "models": models, "running": stats.running,
                    "queued": stats.queued}),
            )
            .into())
        }
        Route::Metrics => {
            let stats = state.engine.stats().into_result().map_err(engine_error)?;
            let text = state.metrics.render(&stats);
            let mut r = Response::new(Full::new(Bytes::from(text)).boxed());
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain; version=0.0.4"),
            );
            Ok(r.into())
        }
        Route::Models => {
            let listed = models.iter().filter(|m| m.as_str() != u_sdk::ANY_MODEL);
            let data: Vec<Value> = listed.map(|m| model_object(m)).collect();
            Ok(json_response(200, &json!({"object": "list", "data": data})).into())
        }
        Route::Model => {
            let id = &path["/v1/models/".len()..];
            if u_sdk::serves(&models, id) {
                Ok(json_response(200, &model_object(id)).into())
            } else {
                Err(ApiError::model_not_found(id))
            }
        }
        Route::Chat | Route::Completions => {
            let endpoint = if route == Route::Chat {
                Endpoint::Chat
            } else {
                Endpoint::Completions
            };
            let mut parsed = openai::parse(endpoint, &body, &models, max)?;
            let reply = openai::Meta::new(endpoint, &parsed);
            from_peer(&mut parsed.request, (peer, owner), keyed);
            if parsed.is_single() {
                generate(state, route, parsed.request, parsed.stream, reply, line).await
            } else {
                several(state, route, parsed, reply, line).await
            }
        }
        Route::Messages => {
            let mut parsed = anthropic::parse(&body, &models)?;
            let reply = anthropic::Message::new(parsed.request.model.as_str()).with_tools(
                if parsed.tools {
                    crate::tools::declared_names(&parsed.request)
                } else {
                    Vec::new()
                },
            );
            from_peer(&mut parsed.request, (peer, owner), keyed);
            generate(state, route, parsed.request, parsed.stream, reply, line).await
        }
        Route::Safebox => {
            let mut parsed = safebox::parse(&body, &models, max)?;
            let reply = safebox::Answer::new(parsed.request.model.as_str());
            from_peer(&mut parsed.request, (peer, owner), keyed);
            generate(state, route, parsed.request, parsed.stream, reply, line).await
        }
        Route::SglGenerate => {
            let mut parsed = sglang::parse(&body, &models)?;
            from_peer(&mut parsed.request, (peer, owner), keyed);
            generate(
                state,
                route,
                parsed.request,
                parsed.stream,
                parsed.reply,
                line,
            )
            .await
        }
        Route::SglModelInfo => Ok(json_response(200, &sglang::model_info(&models)?).into()),
        Route::Transcriptions | Route::Translations => {
            let translate = route == Route::Translations;
            let mut form =
                crate::audio::parse(content_type.as_deref(), body, &models, translate).await?;
            form.request.client = peer.into();
            let t = crate::audio::run(state.engine.clone(), form.request).await?;
            Ok(match crate::audio::reply(&t, form.format, translate) {
                crate::audio::Reply::Json(v) => json_response(200, &v),
                crate::audio::Reply::Text { body, content_type } => {
                    let mut r = Response::new(Full::new(Bytes::from(body)).boxed());
                    r.headers_mut()
                        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
                    r
                }
            }
            .into())
        }
        Route::SglFlushCache => {
            // SGLang answers in plain text: 200 when flushed, 400 when requests are in flight.
            let mut flushed = 0;
            for m in &models {
                match state.engine.flush_cache(m.as_str().into()).into_result() {
                    Ok(n) => flushed += n,
                    Err(e) if e.kind == u_sdk::ErrorKind::Busy => {
                        return Err(ApiError::status(400, "invalid_request_error", e.message));
                    }
                    Err(e) => return Err(engine_error(e)),
                }
            }
            let text = format!("Cache flushed ({flushed} cached prefixes dropped).\n");
            let mut r = Response::new(Full::new(Bytes::from(text)).boxed());
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain; charset=utf-8"),
            );
            Ok(r.into())
        }
        Route::LoadAdapter | Route::UnloadAdapter => {
            // vLLM's runtime adapter endpoints; with admin clients configured, theirs alone.
            if !state.admins.is_empty() && !admin {
                return Err(ApiError::status(
                    403,
                    "permission_error",
                    "loading and unloading adapters is for the admin clients (admin_clients)",
                ));
            }
            let o = crate::json::object(&body)?;
            let name = crate::json::required_string(&o, "lora_name")?;
            let text = if route == Route::LoadAdapter {
                let path = crate::json::required_string(&o, "lora_path")?;
                let engine = state.engine.clone();
                let (n, p) = (name.clone(), path.clone());
                tokio::task::spawn_blocking(move || {
                    engine
                        .load_adapter(n.as_str().into(), p.as_str().into())
                        .into_result()
                })
                .await
                .map_err(|e| ApiError::status(500, "api_error", e.to_string()))?
                .map_err(|e| match e.kind {
                    u_sdk::ErrorKind::AlreadyExists => {
                        ApiError::status(400, "invalid_request_error", e.message)
                    }
                    _ => engine_error(e),
                })?;
                format!("Success: LoRA adapter '{name}' added successfully.")
            } else {
                match state
                    .engine
                    .unload_adapter(name.as_str().into())
                    .into_result()
                {
                    Ok(true) => format!("Success: LoRA adapter '{name}' removed successfully."),
                    Ok(false) => {
                        return Err(ApiError::status(
                            404,
                            "not_found_error",
                            format!("The lora adapter '{name}' cannot be found."),
                        ));
                    }
                    Err(e) => return Err(engine_error(e)),
                }
            };
            let mut r = Response::new(Full::new(Bytes::from(text)).boxed());
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain; charset=utf-8"),
            );
            Ok(r.into())
        }
        Route::ImageVariations => {
            let mut parsed =
                crate::variations::parse(content_type.as_deref(), body, &models).await?;
            parsed.request.client = peer.into();
            let updates = crate::generations::start(state.engine.clone(), &parsed);
            let v = crate::generations::whole(updates).await?;
            Ok(json_response(200, &v).into())
        }
        Route::ImageGenerations => {
            let mut parsed = crate::generations::parse(&body, &models)?;
            parsed.request.client = peer.into();
            let mut updates = crate::generations::start(state.engine.clone(), &parsed);
            if !parsed.stream {
                let v = crate::generations::whole(updates).await?;
                return Ok(json_response(200, &v).into());
            }
            // A request refused before its first step is still answered with a status.
            let first = match updates.recv().await {
                Some(crate::generations::Update::Failed(e)) => {
                    return Err(ApiError::from_engine(&e));
                }
                None => return Err(ApiError::status(500, "server_error", "the engine stopped")),
                Some(first) => first,
            };
            let (tx, rx) = mpsc::channel::<Bytes>(32);
            let (state, line) = (state.clone(), line.clone());
            tokio::spawn(async move {
                let mut next = Some(first);
                loop {
                    let u = match next.take() {
                        Some(u) => u,
                        None => match updates.recv().await {
                            Some(u) => u,
                            None => break,
                        },
                    };
                    let event = crate::generations::event(&u);
                    if tx.send(Bytes::from(event)).await.is_err() {
                        break;
                    }
                }
                state.finished(route, &line, 200, None);
            });
            Ok(Answered {
                response: event_stream(rx),
                recorded: true,
                usage: None,
            })
        }
        Route::Embeddings => {
            let v = tokens::embeddings(state.engine.clone(), &body, &models).await?;
            Ok(json_response(200, &v).into())
        }
        Route::Tokenize => {
            let v = tokens::tokenize(state.engine.clone(), &body, &models).await?;
            Ok(json_response(200, &v).into())
        }
        Route::Detokenize => {
            let v = tokens::detokenize(state.engine.clone(), &body, &models).await?;
            Ok(json_response(200, &v).into())
        }
        Route::CountTokens => {
            let v = tokens::count_tokens(state.engine.clone(), &body, &models).await?;
            Ok(json_response(200, &v).into())
        }
        Route::Checkpoints | Route::CheckpointFork | Route::CheckpointGraft | Route::Checkpoint => {
            let model = checkpoints::query_param(query.as_deref(), "model");
            let request = match (route, &method) {
                (Route::Checkpoints, &Method::GET) => {
                    checkpoints::simple(CheckpointOp::List, "", model, &models)?
                }
                (Route::Checkpoints, _) => checkpoints::parse(CheckpointOp::Save, &body, &models)?,
                (Route::CheckpointFork, _) => {
                    checkpoints::parse(CheckpointOp::Fork, &body, &models)?
                }
                (Route::CheckpointGraft, _) => {
                    checkpoints::parse(CheckpointOp::Graft, &body, &models)?
                }
                _ => {
                    let name = &path["/v1/checkpoints/".len()..];
                    checkpoints::simple(CheckpointOp::Delete, name, model, &models)?
                }
            };
            let request = CheckpointRequest {
                owner: owner.into(),
                admin,
                ..request
            };
            let engine = state.engine.clone();
            let op = request.op;
            let infos =
                tokio::task::spawn_blocking(move || engine.checkpoint(&request).into_result())
                    .await
                    .map_err(|_| ApiError::status(500, "server_error", "the engine stopped"))?
                    .map_err(|e| ApiError::from_engine(&e))?;
            let status = if matches!(op, CheckpointOp::List | CheckpointOp::Delete) {
                200
            } else {
                201
            };
            let answer = if admin {
                checkpoints::answer_for_admin(op, &infos, &state.clients)
            } else {
                checkpoints::answer(op, &infos)
            };
            Ok(json_response(status, &answer).into())
        }
        Route::Unknown | Route::MessagesOther => unreachable!("answered above"),
    }
}

/// Makes the connection's peer the request's fair-queueing key unless it named its user (an
/// API key's name, `keyed`, is the key whatever the request says), and `owner` the owner of
/// the checkpoints it names.
fn from_peer(request: &mut GenerateRequest, (peer, owner): (&str, &str), keyed: bool) {
    if keyed || request.client.is_empty() {
        request.client = peer.into();
    }
    request.owner = owner.into();
}

/// The Safebox authentication headers, as text: timestamp, nonce, signature, key id.
fn signature_headers(h: &hyper::HeaderMap) -> [Option<String>; 4] {
    [
        safebox::TIMESTAMP,
        safebox::NONCE,
        safebox::SIGNATURE,
        safebox::KEY_ID,
    ]
    .map(|name| {
        h.get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    })
}

fn model_object(id: &str) -> Value {
    json!({"id": id, "object": "model", "created": 0, "owned_by": "u"})
}

async fn read_body(state: &State, req: Request<Incoming>, max: usize) -> Result<Bytes, ApiError> {
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

/// Runs `request` and answers in `reply`'s dialect, whole or streamed.
async fn generate(
    state: &Arc<State>,
    route: Route,
    request: GenerateRequest,
    stream: bool,
    mut reply: impl Reply,
    line: &Line,
) -> Result<Answered, ApiError> {
    let mut events = bridge::start(state.engine.clone(), request);
    let stopped = || ApiError::status(500, "server_error", "the engine stopped");
    if !stream {
        let mut pieces = Vec::new();
        loop {
            match events.recv().await {
                Some(Event::Piece(p)) => {
                    if pieces.is_empty() {
                        state
                            .metrics
                            .first_token(route.label(), line.arrived.elapsed());
                    }
                    pieces.push(p);
                }
                Some(Event::Done(summary)) => {
                    let mut answered: Answered =
                        json_response(200, &reply.whole(&pieces, &summary)).into();
                    answered.usage = Some(Usage::of(&summary));
                    return Ok(answered);
                }
                Some(Event::Failed(e)) => return Err(ApiError::from_engine(&e)),
                None => return Err(stopped()),
            }
        }
    }
    // Errors the engine finds before the first token (a full queue, an empty prompt, a full
    // context) are still answered with a status; after that the stream has begun.
    let first = match events.recv().await {
        Some(Event::Failed(e)) => return Err(ApiError::from_engine(&e)),
        None => return Err(stopped()),
        Some(first) => first,
    };
    if matches!(first, Event::Piece(_)) {
        state
            .metrics
            .first_token(route.label(), line.arrived.elapsed());
    }
    let (tx, rx) = mpsc::channel::<Bytes>(32);
    let opening = reply.opening();
    let (state, line) = (state.clone(), line.clone());
    tokio::spawn(async move {
        let usage = stream_events(opening, reply, first, events, tx).await;
        state.finished(route, &line, 200, usage);
    });
    Ok(Answered {
        response: event_stream(rx),
        recorded: true,
        usage: None,
    })
}

/// Answers an OpenAI request of several choices (see [`choices`]).
async fn several(
    state: &Arc<State>,
    route: Route,
    parsed: openai::Parsed,
    meta: openai::Meta,
    line: &Line,
) -> Result<Answered, ApiError> {
    let engine = state.engine.clone();
    let echoes = match parsed.echo {
        false => vec![None; parsed.prompts.len().max(1)],
        true => parsed
            .prompts
            .iter()
            .map(|p| choices::echo_text(&engine, &parsed.request.model, p).map(Some))
            .collect::<Result<_, _>>()?,
    };
    let groups = parsed.groups();
    let (count, n) = (groups.len(), parsed.n as usize);
    let mut events = choices::start(engine, groups);
    if !parsed.stream {
        let sizes = (count, parsed.best_of as usize, n);
        let whole = choices::whole(events, &meta, sizes, &echoes).await?;
        return Ok(json_response(200, &whole).into());
    }
    let first = match events.recv().await {
        Some(choices::Tagged {
            event: Event::Failed(e),
            ..
        }) => return Err(ApiError::from_engine(&e)),
        None => return Err(ApiError::status(500, "server_error", "the engine stopped")),
        Some(first) => first,
    };
    state
        .metrics
        .first_token(route.label(), line.arrived.elapsed());
    let (tx, rx) = mpsc::channel::<Bytes>(32);
    let (state, line) = (state.clone(), line.clone());
    tokio::spawn(async move {
        choices::stream(first, events, meta, (count, n), echoes, tx).await;
        state.finished(route, &line, 200, None);
    });
    Ok(Answered {
        response: event_stream(rx),
        recorded: true,
        usage: None,
    })
}

/// A `text/event-stream` response fed from `rx`.
fn event_stream(rx: mpsc::Receiver<Bytes>) -> Response<Body> {
    let mut r = Response::new(ChannelBody(rx).boxed());
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

/// Turns engine events into SSE frames; returns the tokens of a generation that ended.
/// Returning early (the client went away) drops `events`, which cancels the generation.
async fn stream_events(
    opening: Vec<String>,
    mut reply: impl Reply,
    first: Event,
    mut events: mpsc::Receiver<Event>,
    tx: mpsc::Sender<Bytes>,
) -> Option<Usage> {
    let send = |frames: Vec<String>| {
        let tx = tx.clone();
        async move {
            for f in frames {
                if tx.send(Bytes::from(f)).await.is_err() {
                    return false;
                }
            }
            true
        }
    };
    if !send(opening).await {
        return None;
    }
    let mut next = Some(first);
    loop {
        let event = match next.take() {
            Some(e) => Some(e),
            None => events.recv().await,
        };
        let frames = match event {
            Some(Event::Piece(p)) => reply.piece(&p),
            Some(Event::Done(summary)) => {
                send(reply.closing(&summary)).await;
                return Some(Usage::of(&summary));
            }
            Some(Event::Failed(e)) => {
                send(vec![reply.error(&ApiError::from_engine(&e))]).await;
                return None;
            }
            None => return None,
        };
        if !send(frames).await {
            return None;
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
