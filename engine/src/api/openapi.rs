//! `GET /v1/openapi.json`: the HTTP API as an OpenAPI 3.1 document, built
//! by `utoipa` from the very types the handlers parse and answer with: the
//! bodies the [`Json`](super::extract::Json) extractor reads
//! (`SubmitJob`, `SubmitBatch`, `Action`, `BulkCancel`, …), the queries
//! [`Query`](super::extract::Query) reads (`ListQuery`, `RedriveQuery`,
//! `ScheduleQuery`), and the answers (`JobView`, `JobPage`, `ErrorBody`,
//! …). No type exists here for the document alone, so the document cannot
//! drift from the server: `engine/tests/openapi.rs` checks that every route
//! `configure` registers (but the console's page and assets) is in the
//! document, and nothing else, and `tests/it/security.rs`
//! (`the_document_names_every_parameter_and_field_the_server_takes`) that
//! the server takes every parameter and body field the document names and
//! refuses one it does not.

use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

use super::batch::{BatchAnswer, BatchItem, SubmitBatch};
use super::console::Stats;
use super::error::{ErrorBody, ErrorDetail};
use super::events::SseEvent;
use super::jobs::JobPage;
use super::metrics::Health;
use super::operate::{Action, BulkCancel, BulkCancelled, BulkRedrive, BulkRedriven, Rerun};
use super::schedules::{CreateSchedule, SchedulePage};
use super::signals::SignalBody;
use super::*;
use crate::error::ErrorEnvelope;
use crate::node::intake::SubmitJob;
use crate::rules::lifecycle::JobState;
use crate::store::jobs::{
    ChildView, DeliveryView, HistoryEntry, JobSummary, JobView, ModelCallView, ToolCallView,
};
use crate::store::schedules::{ScheduleDetail, ScheduleView, ScheduledJob};
use crate::store::waits::SignalView;

/// Bearer tokens (`onceflow token create`).
struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(
                        "An API token: `Authorization: Bearer <token>`. Not needed in development mode",
                    ))
                    .build(),
            ),
        );
    }
}

/// The answers every operation may give besides its own, added to each
/// (none replaces what a path states): `421` a `Host` the node does not
/// answer for, `503` the database down or the node draining, `401` without
/// a token on a secured path; with a request body, `400` not JSON, `413`
/// too large, `415` not `application/json`, `408` not received in time;
/// with query or header parameters, `400`; with a path parameter, `422`
/// a bad one (a NUL, say).
struct CommonErrors;

impl Modify for CommonErrors {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::{ContentBuilder, Ref, RefOr, ResponseBuilder};
        let answer = |description: &str| {
            RefOr::T(
                ResponseBuilder::new()
                    .description(description)
                    .content(
                        "application/json",
                        ContentBuilder::new()
                            .schema(Some(Ref::from_schema_name("ErrorBody")))
                            .build(),
                    )
                    .build(),
            )
        };
        for (path, item) in openapi.paths.paths.iter_mut() {
            let open = matches!(path.as_str(), "/healthz" | "/v1/openapi.json");
            for op in [
                &mut item.get,
                &mut item.post,
                &mut item.put,
                &mut item.delete,
                &mut item.patch,
            ]
            .into_iter()
            .flatten()
            {
                let mut add = |code: &str, description: &str| {
                    op.responses
                        .responses
                        .entry(code.to_owned())
                        .or_insert_with(|| answer(description));
                };
                add("421", "Misdirected: a Host this node does not answer for");
                if !open {
                    add("401", "No token, or a bad one");
                    add(
                        "503",
                        "The database is unavailable, or the node is draining",
                    );
                }
                if path.contains('{') {
                    add("422", "A bad path parameter (named)");
                }
                if op.request_body.is_some() {
                    add("400", "Malformed JSON");
                    add("413", "The body is too large");
                    add("415", "Not application/json");
                    add("408", "The body did not arrive within 30 s");
                }
                let queried = op.parameters.iter().flatten().any(|p| {
                    matches!(
                        p,
                        RefOr::T(p) if matches!(
                            p.parameter_in,
                            utoipa::openapi::path::ParameterIn::Query
                                | utoipa::openapi::path::ParameterIn::Header
                        )
                    )
                });
                if queried {
                    add("400", "A bad query parameter or header");
                }
            }
        }
    }
}

#[derive(OpenApi)]
#[openapi(
    info(title = "onceflow", description = "Durable LLM jobs: each model call, tool call and webhook once per job."),
    paths(
        super::jobs::submit, super::batch::submit_batch, super::jobs::list_jobs, super::console::stats, super::operate::redrive_bulk, super::operate::cancel_bulk, super::jobs::get_job, super::events::job_events, super::operate::cancel, super::operate::redrive, super::operate::rerun, super::signals::signal, super::schedules::create_schedule, super::schedules::list_schedules, super::schedules::get_schedule, super::schedules::delete_schedule, super::schedules::pause_schedule, super::schedules::resume_schedule, super::metrics::healthz, super::metrics::metrics, openapi_json
    ),
    components(schemas(
        JobView, JobSummary, HistoryEntry, DeliveryView, ModelCallView, ToolCallView, ChildView,
        SignalView, JobState, ErrorEnvelope, ScheduleView, ScheduleDetail, ScheduledJob,
        ErrorBody, ErrorDetail, SubmitJob, SseEvent, JobPage, Stats, Action, BulkRedrive, BulkRedriven, BulkCancel, BulkCancelled, Rerun, SubmitBatch, BatchItem, BatchAnswer,
        SignalBody, CreateSchedule, SchedulePage, Health, crate::store::budgets::Spend,
        crate::rules::wait_machine::Waiting, crate::rules::wait_machine::ApprovalCall
    )),
    modifiers(&BearerAuth, &CommonErrors),
    security(("bearer" = []))
)]
struct ApiDoc;

/// The methods the API serves on `path` (`"GET, POST"`), when it is one
/// of the document's paths; the console's own page and assets aside.
pub(super) fn methods_of(path: &str) -> Option<String> {
    static PATHS: std::sync::OnceLock<Vec<(actix_web::dev::ResourceDef, String)>> =
        std::sync::OnceLock::new();
    let paths = PATHS.get_or_init(|| {
        let doc = serde_json::to_value(document()).expect("the document serialises");
        let mut paths = Vec::new();
        if let Some(items) = doc["paths"].as_object() {
            for (pattern, item) in items {
                let methods: Vec<String> = ["get", "post", "put", "delete", "patch"]
                    .into_iter()
                    .filter(|m| item.get(*m).is_some())
                    .map(|m| m.to_uppercase())
                    .collect();
                paths.push((
                    actix_web::dev::ResourceDef::new(pattern.as_str()),
                    methods.join(", "),
                ));
            }
        }
        paths
    });
    paths
        .iter()
        .find(|(def, _)| def.is_match(path))
        .map(|(_, methods)| methods.clone())
}

/// The query parameters the document gives operation `method` `path`
/// (a request's concrete path), when the document has that operation: the
/// one list the front door checks a query string against, so a parameter
/// the server takes is one the document describes.
pub(super) fn query_params_of(method: &str, path: &str) -> Option<&'static [String]> {
    type Operations = Vec<(actix_web::dev::ResourceDef, String, Vec<String>)>;
    static OPERATIONS: std::sync::OnceLock<Operations> = std::sync::OnceLock::new();
    let operations = OPERATIONS.get_or_init(|| {
        let doc = serde_json::to_value(document()).expect("the document serialises");
        let mut operations = Vec::new();
        for (pattern, item) in doc["paths"].as_object().into_iter().flatten() {
            for (verb, operation) in item.as_object().into_iter().flatten() {
                let names = operation["parameters"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter(|p| p["in"] == "query")
                    .filter_map(|p| p["name"].as_str().map(str::to_owned))
                    .collect();
                operations.push((
                    actix_web::dev::ResourceDef::new(pattern.as_str()),
                    verb.to_uppercase(),
                    names,
                ));
            }
        }
        operations
    });
    // Paths sort static segments before `{…}` ones: `/v1/jobs/cancel` is
    // found before `/v1/jobs/{id}` matches it.
    operations
        .iter()
        .find(|(def, verb, _)| verb == method && def.is_match(path))
        .map(|(_, _, names)| names.as_slice())
}

/// The document, as served to a caller without a token.
pub fn document() -> serde_json::Value {
    let mut doc = ApiDoc::openapi();
    doc.info.version = env!("CARGO_PKG_VERSION").to_owned();
    let mut doc = serde_json::to_value(doc).expect("the document serialises");
    finish(&mut doc);
    link(&mut doc);
    stream_as_events_or_text(&mut doc);
    doc
}

/// The event stream's `200`: each event an `SseEvent` (what an SSE-aware
/// tool such as Schemathesis checks every event against), or the stream's
/// text (what a generated client, which reads the whole body, gets).
fn stream_as_events_or_text(doc: &mut serde_json::Value) {
    let schema = &mut doc["paths"]["/v1/jobs/{id}/events"]["get"]["responses"]["200"]["content"]
        ["text/event-stream"]["schema"];
    *schema = serde_json::json!({
        "anyOf": [
            { "$ref": "#/components/schemas/SseEvent" },
            { "type": "string", "description": "The stream's whole text, to a client that reads the body at once." },
        ],
    });
}

/// OpenAPI `links`: what a created job or schedule leads to, with its id
/// taken from the answer's body (`$response.body#/id`), so a tool that
/// follows them (Schemathesis' stateful phase, a client generator) chains
/// submit → get → signal → cancel, and create → get → pause → delete.
fn link(doc: &mut serde_json::Value) {
    let by_id = |operations: &[&str]| -> serde_json::Value {
        operations
            .iter()
            .map(|op| {
                (
                    (*op).to_owned(),
                    serde_json::json!({
                        "operationId": op,
                        "parameters": { "id": "$response.body#/id" },
                    }),
                )
            })
            .collect::<serde_json::Map<_, _>>()
            .into()
    };
    let jobs = by_id(&["get_job", "signal", "cancel", "rerun", "redrive"]);
    let schedules = by_id(&[
        "get_schedule",
        "pause_schedule",
        "resume_schedule",
        "delete_schedule",
    ]);
    for (path, method, statuses, links) in [
        ("/v1/jobs", "post", &["200", "201"][..], &jobs),
        ("/v1/jobs/{id}", "get", &["200"][..], &jobs),
        ("/v1/schedules", "post", &["200", "201"][..], &schedules),
    ] {
        for status in statuses {
            if let Some(response) = doc
                .pointer_mut(&format!(
                    "/paths/{}/{method}/responses/{status}",
                    path.replace('~', "~0").replace('/', "~1")
                ))
                .and_then(serde_json::Value::as_object_mut)
            {
                response.insert("links".into(), links.clone());
            }
        }
    }
}

/// What utoipa leaves out and OpenAPI 3.1 or a client generator needs:
/// every response a `description` (its status's reason phrase where the
/// handler gave none); no field the server defaults among an object's
/// `required`, and its default said in its description rather than as
/// `default` (openapi-typescript types a field with a `default` as always
/// present, so a request leaving it out would not compile); an object
/// without properties open to any (`additionalProperties: true`, which a
/// generator otherwise types as an empty record).
fn finish(doc: &mut serde_json::Value) {
    use serde_json::Value;
    if let Some(paths) = doc.get_mut("paths").and_then(Value::as_object_mut) {
        for item in paths.values_mut() {
            let Some(item) = item.as_object_mut() else {
                continue;
            };
            for op in item.values_mut() {
                let Some(responses) = op.get_mut("responses").and_then(Value::as_object_mut) else {
                    continue;
                };
                for (code, response) in responses.iter_mut() {
                    let Some(response) = response.as_object_mut() else {
                        continue;
                    };
                    let described = response
                        .get("description")
                        .and_then(Value::as_str)
                        .is_some_and(|d| !d.is_empty());
                    if !described && !response.contains_key("$ref") {
                        let reason = code
                            .parse::<u16>()
                            .ok()
                            .and_then(|c| actix_web::http::StatusCode::from_u16(c).ok())
                            .and_then(|c| c.canonical_reason())
                            .unwrap_or("Response");
                        response.insert("description".into(), reason.into());
                    }
                }
            }
        }
    }
    /// A JSON value of the document; `names` when it is a map of names to
    /// schemas (`properties`, `components.schemas`, …), not a schema: its
    /// keys (a property called `default`, say) are names, left alone.
    fn fix(value: &mut Value, names: bool) {
        match value {
            Value::Object(map) if names => map.values_mut().for_each(|v| fix(v, false)),
            Value::Object(map) => {
                let defaulted: Vec<String> = map
                    .get("properties")
                    .and_then(Value::as_object)
                    .map(|props| {
                        props
                            .iter()
                            .filter(|(_, p)| p.get("default").is_some())
                            .map(|(name, _)| name.clone())
                            .collect()
                    })
                    .unwrap_or_default();
                if let Some(Value::Array(required)) = map.get_mut("required") {
                    required
                        .retain(|r| !r.as_str().is_some_and(|r| defaulted.iter().any(|d| d == r)));
                }
                let object = match map.get("type") {
                    Some(Value::String(t)) => t == "object",
                    Some(Value::Array(ts)) => ts.iter().any(|t| t == "object"),
                    _ => false,
                };
                if object
                    && !map.contains_key("properties")
                    && !map.contains_key("additionalProperties")
                {
                    map.insert("additionalProperties".into(), Value::Bool(true));
                }
                if map.contains_key("type") || map.contains_key("enum") {
                    if let Some(default) = map.remove("default") {
                        let said = format!("Default: `{default}`.");
                        let description = match map.get("description").and_then(Value::as_str) {
                            Some(d) if !d.is_empty() => format!("{d} {said}"),
                            _ => said,
                        };
                        map.insert("description".into(), description.into());
                    }
                }
                for (key, v) in map.iter_mut() {
                    let names = matches!(
                        key.as_str(),
                        "properties" | "schemas" | "$defs" | "definitions" | "patternProperties"
                    );
                    fix(v, names);
                }
            }
            Value::Array(items) => items.iter_mut().for_each(|v| fix(v, false)),
            _ => {}
        }
    }
    fix(doc, false);
}

/// `GET /v1/openapi.json`: open, like `/healthz`. Without a valid token
/// (where tokens exist) it is the API alone, which holds nothing secret;
/// a caller the API would serve also gets this node's workflows and their
/// inputs ([`document_for`]), which name a deployment's own work.
#[utoipa::path(get, path = "/v1/openapi.json", tag = "operate", security(()),
    responses((status = 200, description = "This document", content_type = "application/json", body = Object)))]
pub(super) async fn openapi_json(state: web::Data<ApiState>, req: HttpRequest) -> HttpResponse {
    if authenticate(&state, &req).await.is_err() {
        static OPEN: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        let body = OPEN.get_or_init(|| document().to_string());
        return HttpResponse::Ok()
            .content_type("application/json")
            .body(body.clone());
    }
    // Built once per registry (a node has one): keyed by its workflows.
    type Built = Option<(Vec<(&'static str, u32)>, std::sync::Arc<str>)>;
    static DOC: std::sync::Mutex<Built> = std::sync::Mutex::new(None);
    let key: Vec<(&'static str, u32)> = state
        .registry
        .names()
        .filter_map(|n| state.registry.get(n).map(|w| (n, w.version())))
        .collect();
    let body = {
        let mut doc = DOC.lock().unwrap_or_else(|e| e.into_inner());
        match &*doc {
            Some((built_for, body)) if *built_for == key => body.clone(),
            _ => {
                let body: std::sync::Arc<str> = document_for(&state.registry).to_string().into();
                *doc = Some((key, body.clone()));
                body
            }
        }
    };
    HttpResponse::Ok()
        .content_type("application/json")
        .body(body.to_string())
}

/// The document as a node serves it: the request bodies that name a
/// workflow (`SubmitJob`, `CreateSchedule`) become one variant per
/// registered workflow (`oneOf`), its name the `workflow` and its
/// [`Workflow::input_schema`](crate::Workflow::input_schema), when it has
/// one, the `input`; so a client sees, say, `completion`'s and `agent`'s
/// inputs, and the names this node runs. A workflow's
/// [`output_schema`](crate::Workflow::output_schema) is the component
/// `Result_{workflow}`, named in `JobView.result`'s description.
pub fn document_for(registry: &crate::Registry) -> serde_json::Value {
    let mut doc = document();
    for base in ["SubmitJob", "CreateSchedule"] {
        let template = doc["components"]["schemas"][base].clone();
        let mut refs = Vec::new();
        let mut mapping = serde_json::Map::new();
        for name in registry.names() {
            let mut variant = template.clone();
            variant["properties"]["workflow"] =
                serde_json::json!({ "type": "string", "const": name });
            if let Some(input) = registry.get(name).and_then(|w| w.input_schema()) {
                variant["properties"]["input"] = input;
            }
            // A component of its own, so generators make one model per
            // workflow: `SubmitJob_completion`.
            let component = format!("{base}_{}", component_name(name));
            let reference = format!("#/components/schemas/{component}");
            doc["components"]["schemas"][&component] = variant;
            refs.push(serde_json::json!({ "$ref": reference }));
            mapping.insert(name.to_owned(), reference.into());
        }
        if !refs.is_empty() {
            doc["components"]["schemas"][base] = serde_json::json!({
                "description": template["description"],
                "oneOf": refs,
                "discriminator": { "propertyName": "workflow", "mapping": mapping },
            });
        }
    }
    // What each workflow's jobs return, where it says: `Result_completion`.
    let mut results = Vec::new();
    for name in registry.names() {
        if let Some(output) = registry.get(name).and_then(|w| w.output_schema()) {
            let component = format!("Result_{}", component_name(name));
            let mut schema = output;
            if schema.get("description").is_none() {
                schema["description"] = format!("The `result` of a finished `{name}` job.").into();
            }
            doc["components"]["schemas"][&component] = schema;
            results.push(format!("`{name}`: `{component}`"));
        }
    }
    if !results.is_empty() {
        let described = doc["components"]["schemas"]["JobView"]["properties"]["result"]
            ["description"]
            .as_str()
            .unwrap_or("")
            .to_owned();
        doc["components"]["schemas"]["JobView"]["properties"]["result"]["description"] = format!(
            "{described} Its schema, by the job's `workflow`: {}.",
            results.join(", ")
        )
        .into();
    }
    finish(&mut doc);
    doc
}

/// A workflow's name as part of a component's name (`A-Z a-z 0-9 . _ -`).
fn component_name(workflow: &str) -> String {
    workflow
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect()
}
