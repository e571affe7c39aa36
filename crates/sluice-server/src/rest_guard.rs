//! Who a REST request comes from, and whether it may come at all: every request of the REST API
//! and the web UI passes [`guard`] before its handler.
//!
//! ```text
//!  request ─► Host is a listed name? ──no──► 403
//!               │ yes
//!               ▼
//!  state-changing (POST, …) from another origin (Origin: scheme, host and port; or
//!  Sec-Fetch-Site other than same-origin/none)? ──yes──► 403
//!               │ no
//!               ▼
//!  public (the UI's files, POST /api/v1/login, /metrics with --metrics-public)? ──yes──► handler
//!               │ no
//!               ▼
//!  server without accounts ──► handler as an admin (loopback only)
//!  Basic credentials, `Authorization: Bearer TOKEN` or the `sluice_token` cookie ──► handler as
//!  that user (the [`Caller`] extension) · none or wrong ──► 401
//! ```
//!
//! Invariants:
//! - The Host check runs on every request, reads included, so a page that rebinds its own DNS
//!   name to this address (DNS rebinding) is refused before any data is read.
//! - A token is a session token of the server ([`Sessions`]): the Flight SQL handshake's and
//!   `POST /api/v1/login`'s are the same kind, with the same idle expiry; the cookie that carries
//!   it is `HttpOnly; SameSite=Strict` (and `Secure` over TLS), so page scripts never see it and
//!   other sites never send it.
//! - Basic credentials pass the same login limits as the other doors' logins.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{ConnectInfo, Request, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use serde_json::json;
use sluice_engine::access::Role;

use crate::sessions::Sessions;

/// The cookie the web UI's session token travels in.
pub const TOKEN_COOKIE: &str = "sluice_token";

/// Who sent a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// Anyone on a server without accounts (which listens on loopback only): an admin.
    Anyone,
    /// A logged-in user.
    User {
        /// The user's name.
        name: String,
        /// The user's role.
        role: Role,
    },
}

impl Caller {
    /// Whether the caller may see and cancel every job.
    pub fn is_admin(&self) -> bool {
        match self {
            Caller::Anyone => true,
            Caller::User { role, .. } => *role == Role::Admin,
        }
    }

    /// Whether the caller may see (and cancel) a job submitted by `owner` (`None`: a job no
    /// front door submitted).
    pub fn may_see(&self, owner: Option<&str>) -> bool {
        match self {
            Caller::Anyone => true,
            Caller::User { name, role } => *role == Role::Admin || owner == Some(name.as_str()),
        }
    }
}

/// The checks' settings: which Host names the endpoint answers to and what is public.
#[derive(Debug, Clone)]
pub struct Guard {
    /// Lower-case host names (no port) a request's Host may carry.
    hosts: BTreeSet<String>,
    /// Whether `/metrics` is served without credentials.
    metrics_public: bool,
    /// Whether the endpoint serves TLS (the cookie is `Secure` then).
    tls: bool,
    /// The port it listens on (an Origin must name it).
    port: u16,
}

impl Guard {
    /// The checks of an endpoint on `address`: it answers to its own address, `localhost`, the
    /// loopback addresses and `allowed_hosts`.
    pub fn new(
        address: SocketAddr,
        allowed_hosts: &[String],
        metrics_public: bool,
        tls: bool,
    ) -> Self {
        let mut hosts: BTreeSet<String> = ["localhost", "127.0.0.1", "[::1]"]
            .into_iter()
            .map(String::from)
            .collect();
        hosts.insert(match address {
            SocketAddr::V4(v4) => v4.ip().to_string(),
            SocketAddr::V6(v6) => format!("[{}]", v6.ip()),
        });
        hosts.extend(allowed_hosts.iter().map(|h| h.trim().to_ascii_lowercase()));
        Self {
            hosts,
            metrics_public,
            tls,
            port: address.port(),
        }
    }

    /// Whether `origin` (an `Origin` header: `scheme://host[:port]`) is this endpoint's own: its
    /// scheme, a listed host and its port (another port of the same host is another site's page).
    pub(crate) fn is_own_origin(&self, origin: &str) -> bool {
        let scheme = if self.tls { "https" } else { "http" };
        let Some(authority) = origin
            .trim()
            .to_ascii_lowercase()
            .strip_prefix(scheme)
            .and_then(|rest| rest.strip_prefix("://"))
            .map(str::to_string)
        else {
            return false;
        };
        let default_port = if self.tls { 443 } else { 80 };
        let port = match authority.rsplit_once(':') {
            Some((name, port)) if !name.contains(':') || name.ends_with(']') => port.parse().ok(),
            _ => Some(default_port),
        };
        port == Some(self.port) && self.answers_to(&authority)
    }

    /// Whether `host` (a Host header or an Origin's authority, with or without a port) is one of
    /// the listed names.
    pub(crate) fn answers_to(&self, host: &str) -> bool {
        let host = host.trim().to_ascii_lowercase();
        let name = match host.rsplit_once(':') {
            // `[::1]:8080` or `name:8080`; a bare IPv6 literal has its colons inside brackets.
            Some((name, port))
                if port.chars().all(|c| c.is_ascii_digit())
                    && (!name.contains(':') || name.ends_with(']')) =>
            {
                name.to_string()
            }
            _ => host,
        };
        self.hosts.contains(&name)
    }

    /// The `Set-Cookie` value that stores `token` (an empty token with `Max-Age=0` clears it).
    pub fn cookie(&self, token: &str) -> String {
        let secure = if self.tls { "; Secure" } else { "" };
        let expiry = if token.is_empty() { "; Max-Age=0" } else { "" };
        format!("{TOKEN_COOKIE}={token}; HttpOnly; SameSite=Strict; Path=/{secure}{expiry}")
    }
}

/// What the guard needs of the endpoint.
#[derive(Clone)]
pub struct GuardState {
    /// The checks.
    pub guard: Arc<Guard>,
    /// The server's sessions (accounts and tokens).
    pub sessions: Arc<Sessions>,
}

fn refuse(status: StatusCode, message: impl Into<String>) -> Response {
    let body = axum::Json(json!({ "error": message.into() }));
    if status == StatusCode::UNAUTHORIZED {
        return (
            status,
            [(header::WWW_AUTHENTICATE, "Bearer realm=\"sluice\"")],
            body,
        )
            .into_response();
    }
    (status, body).into_response()
}

/// Whether `method` may change state (only GET, HEAD and OPTIONS may not).
fn changes_state(method: &Method) -> bool {
    !matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS)
}

/// Paths served to anyone who passes the Host (and Origin) checks.
fn is_public(path: &str, method: &Method, guard: &Guard) -> bool {
    matches!(path, "/" | "/ui/" | "/ui/app.js" | "/ui/app.css")
        || (path == "/api/v1/login" && *method == Method::POST)
        || (path == "/metrics" && guard.metrics_public)
}

/// The request's session token: its bearer token, else its cookie.
pub fn token_of(headers: &HeaderMap) -> Option<String> {
    if let Some(token) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
    {
        return Some(token.trim().to_string());
    }
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(name, _)| *name == TOKEN_COOKIE)
        .map(|(_, token)| token.to_string())
}

/// `Authorization: Basic` credentials, if the request carries them.
pub fn basic_credentials(headers: &HeaderMap) -> Option<Result<(String, String), String>> {
    let value = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())?
        .strip_prefix("Basic ")?;
    let decoded = match STANDARD.decode(value.trim()) {
        Ok(decoded) => decoded,
        Err(e) => return Some(Err(format!("basic credentials: {e}"))),
    };
    let Ok(text) = String::from_utf8(decoded) else {
        return Some(Err("basic credentials are not UTF-8".to_string()));
    };
    Some(match text.split_once(':') {
        Some((user, password)) => Ok((user.to_string(), password.to_string())),
        None => Err("basic credentials must be user:password".to_string()),
    })
}

/// The caller named by `user` on `sessions`' server.
fn user_caller(sessions: &Sessions, user: String) -> Caller {
    let role = sessions
        .users()
        .and_then(|users| users.role(&user))
        .unwrap_or(Role::Reader);
    Caller::User { name: user, role }
}

/// The session token a request was authenticated with (a request extension, absent for Basic
/// credentials): what lives as long as a session (an event stream) ends with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionToken(pub String);

/// The middleware: see the module docs.
pub async fn guard(
    State(state): State<GuardState>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    mut request: Request,
    next: Next,
) -> Response {
    let headers = request.headers();
    let host = headers
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    if !state.guard.answers_to(host) {
        return refuse(
            StatusCode::FORBIDDEN,
            format!("this server does not answer to the host '{host}' (see --http-allowed-host)"),
        );
    }
    if changes_state(request.method()) {
        // A browser says where a request comes from: only this endpoint's own pages (or the
        // user typing, `none`) may change state. Other clients (curl, scripts) send neither.
        let cross_site = headers
            .get("sec-fetch-site")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|site| {
                !site.eq_ignore_ascii_case("same-origin") && !site.eq_ignore_ascii_case("none")
            });
        let origin = headers.get(header::ORIGIN).and_then(|v| v.to_str().ok());
        let foreign = origin.is_some_and(|origin| !state.guard.is_own_origin(origin));
        if cross_site || foreign {
            return refuse(
                StatusCode::FORBIDDEN,
                format!(
                    "a {} from another site ({}) is refused",
                    request.method(),
                    origin.unwrap_or("cross-site")
                ),
            );
        }
    }
    let path = request.uri().path().to_string();
    let caller = if !state.sessions.requires_login() {
        Caller::Anyone
    } else if is_public(&path, request.method(), &state.guard) {
        return next.run(request).await;
    } else if let Some(credentials) = basic_credentials(headers) {
        let (user, password) = match credentials {
            Ok(credentials) => credentials,
            Err(message) => return refuse(StatusCode::UNAUTHORIZED, message),
        };
        if let Err(status) = state
            .sessions
            .authenticate(&user, &password, Some(peer.ip()))
            .await
        {
            let code = if status.code() == tonic::Code::ResourceExhausted {
                StatusCode::TOO_MANY_REQUESTS
            } else {
                StatusCode::UNAUTHORIZED
            };
            return refuse(code, status.message());
        }
        user_caller(&state.sessions, user)
    } else if let Some(token) = token_of(headers) {
        match state.sessions.user_of_token(&token) {
            Some(user) => {
                request.extensions_mut().insert(SessionToken(token));
                user_caller(&state.sessions, user)
            }
            None => return refuse(StatusCode::UNAUTHORIZED, "unknown or expired session token"),
        }
    } else {
        return refuse(
            StatusCode::UNAUTHORIZED,
            "this server requires a login: HTTP Basic credentials, or the token of \
             POST /api/v1/login as 'Authorization: Bearer TOKEN'",
        );
    };
    request.extensions_mut().insert(caller);
    next.run(request).await
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    #[test]
    fn hosts_are_listed_names_with_any_port() {
        let guard = Guard::new(
            "127.0.0.1:8080".parse().unwrap(),
            &["Sluice.Example.com".to_string()],
            false,
            false,
        );
        for host in [
            "127.0.0.1:8080",
            "localhost:8080",
            "localhost",
            "[::1]:8080",
            "sluice.example.com",
            "SLUICE.example.com:443",
        ] {
            assert!(guard.answers_to(host), "{host}");
        }
        for host in [
            "evil.example.com",
            "",
            "127.0.0.2:8080",
            "localhost.evil.com",
            "::1",
        ] {
            assert!(!guard.answers_to(host), "{host}");
        }
        // An origin is the endpoint's own only with its scheme, a listed host and its port.
        for origin in [
            "http://localhost:8080",
            "http://127.0.0.1:8080",
            "http://sluice.example.com:8080",
        ] {
            assert!(guard.is_own_origin(origin), "{origin}");
        }
        for origin in [
            "http://localhost:9999",
            "https://localhost:8080",
            "http://localhost",
            "http://evil.example.com:8080",
            "null",
            "",
        ] {
            assert!(!guard.is_own_origin(origin), "{origin}");
        }
        let https = Guard::new("127.0.0.1:443".parse().unwrap(), &[], false, true);
        assert!(https.is_own_origin("https://localhost"));
        assert!(!https.is_own_origin("http://localhost:443"));
    }

    #[test]
    fn tokens_come_from_the_bearer_header_or_the_cookie_and_the_cookie_is_strict() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::COOKIE,
            "a=b; sluice_token=s1.abc; c=d".parse().unwrap(),
        );
        assert_eq!(token_of(&headers).as_deref(), Some("s1.abc"));
        headers.insert(header::AUTHORIZATION, "Bearer s2.def".parse().unwrap());
        assert_eq!(token_of(&headers).as_deref(), Some("s2.def"));
        let guard = Guard::new("127.0.0.1:1".parse().unwrap(), &[], false, true);
        assert_eq!(
            guard.cookie("s1.abc"),
            "sluice_token=s1.abc; HttpOnly; SameSite=Strict; Path=/; Secure"
        );
        assert_eq!(
            guard.cookie(""),
            "sluice_token=; HttpOnly; SameSite=Strict; Path=/; Secure; Max-Age=0"
        );
        let mut basic = HeaderMap::new();
        basic.insert(
            header::AUTHORIZATION,
            "Basic YW5uOnM6M2NyZXQ=".parse().unwrap(),
        );
        assert_eq!(
            basic_credentials(&basic).unwrap().unwrap(),
            ("ann".to_string(), "s:3cret".to_string())
        );
    }
}
