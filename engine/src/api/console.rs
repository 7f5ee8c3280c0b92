//! The web console (`/`) and the counts it shows (`/v1/stats`).

use super::*;

/// `GET /v1/stats`: jobs per state (every state), of the token's own jobs or,
/// for an admin token, of all.
#[utoipa::path(get, path = "/v1/stats", tag = "jobs",
    responses((status = 200, body = Stats), (status = 401, body = ErrorBody)))]
pub(super) async fn stats(Reader(who): Reader, state: web::Data<ApiState>) -> Answer {
    let counts = state
        .store
        .jobs()
        .stats(who.scope())
        .await
        .map_err(unavailable)?;
    let budgets = state
        .store
        .waits()
        .spend_today(who.scope())
        .await
        .map_err(unavailable)?;
    let states = counts
        .into_iter()
        .map(|(s, n)| (s.as_str().to_owned(), n))
        .collect();
    Ok(HttpResponse::Ok().json(Stats { states, budgets }))
}

/// `GET /v1/stats`: jobs by state, and model-token spend against budgets.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub(super) struct Stats {
    /// Jobs in each state (every state named, zero included).
    states: std::collections::BTreeMap<String, u64>,
    /// Each token with a daily model-token budget (a token sees its own):
    /// what its jobs' answers used today (UTC), and the budget.
    budgets: Vec<crate::store::budgets::Spend>,
}

/// The console's files, embedded in the binary.
pub(super) const CONSOLE_HTML: &str = include_str!("console/index.html");
pub(super) const CONSOLE_JS: &str = include_str!("console/console.js");
pub(super) const CONSOLE_CSS: &str = include_str!("console/console.css");

/// Headers every console file carries: its own origin only, no framing.
pub(super) fn console_response(content_type: &'static str, body: String) -> HttpResponse {
    HttpResponse::Ok()
        .content_type(content_type)
        .insert_header((
            "content-security-policy",
            "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; \
             img-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
        ))
        .insert_header(("x-content-type-options", "nosniff"))
        .insert_header(("referrer-policy", "no-referrer"))
        .insert_header(("cache-control", "no-cache"))
        .body(body)
}

/// `GET /`: the web console (it asks for a token itself, when one is needed).
pub(super) async fn console_page(state: web::Data<ApiState>, req: HttpRequest) -> HttpResponse {
    if let Some(refused) = misdirected(&state, &req) {
        return refused.into();
    }
    let trace_url = state.trace_url.as_deref().unwrap_or_default();
    let escaped = trace_url
        .replace('&', "&amp;")
        .replace('"', "&quot;")
        .replace('<', "&lt;")
        .replace('>', "&gt;");
    console_response(
        "text/html; charset=utf-8",
        CONSOLE_HTML.replace("{{TRACE_URL}}", &escaped),
    )
}

pub(super) async fn console_js() -> HttpResponse {
    console_response("text/javascript; charset=utf-8", CONSOLE_JS.to_owned())
}

pub(super) async fn console_css() -> HttpResponse {
    console_response("text/css; charset=utf-8", CONSOLE_CSS.to_owned())
}
