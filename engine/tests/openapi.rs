//! The OpenAPI document (`GET /v1/openapi.json`) against the routes the
//! server registers: every route `api::configure` adds (but the console's
//! page and assets) is in the document with its method, and the document
//! has nothing the server does not answer. Read from the source, as
//! `layers.rs` reads it, so a route added without its description fails.

use std::collections::BTreeSet;

fn registered() -> BTreeSet<(String, String)> {
    let source = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/src/api/mod.rs"))
        .expect("api/mod.rs");
    let mut routes = BTreeSet::new();
    for line in source.lines() {
        let Some(rest) = line.trim().strip_prefix(".route(\"") else {
            continue;
        };
        let (path, rest) = rest.split_once('"').expect("a quoted path");
        let method = rest
            .split("web::")
            .nth(1)
            .and_then(|m| m.split("()").next())
            .expect("web::METHOD()");
        if matches!(path, "/" | "/console.js" | "/console.css") {
            continue; // the console, not the API
        }
        routes.insert((method.to_owned(), path.to_owned()));
    }
    routes
}

#[test]
fn every_registered_route_is_in_the_document_and_nothing_else() {
    let doc = serde_json::to_value(onceflow_engine::api::openapi::document()).unwrap();
    assert!(
        doc["openapi"].as_str().unwrap().starts_with("3.1"),
        "{}",
        doc["openapi"]
    );
    let mut documented = BTreeSet::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for method in item.as_object().unwrap().keys() {
            if matches!(method.as_str(), "get" | "post" | "put" | "delete" | "patch") {
                documented.insert((method.clone(), path.clone()));
            }
        }
    }
    let routes = registered();
    assert!(
        routes.len() >= 18,
        "the source scan found the routes: {routes:?}"
    );
    let missing: Vec<_> = routes.difference(&documented).collect();
    let extra: Vec<_> = documented.difference(&routes).collect();
    assert!(
        missing.is_empty(),
        "registered but not documented: {missing:?}"
    );
    assert!(extra.is_empty(), "documented but not registered: {extra:?}");
}

#[test]
fn the_document_has_bearer_auth_the_event_stream_and_the_error_shape() {
    let doc = serde_json::to_value(onceflow_engine::api::openapi::document()).unwrap();
    assert_eq!(
        doc["components"]["securitySchemes"]["bearer"]["scheme"],
        "bearer"
    );
    let events = &doc["paths"]["/v1/jobs/{id}/events"]["get"]["responses"];
    assert!(
        events["200"]["content"]["text/event-stream"].is_object(),
        "{events}"
    );
    assert!(events["204"].is_object(), "{events}");
    let submit = &doc["paths"]["/v1/jobs"]["post"];
    assert_eq!(
        submit["requestBody"]["content"]["application/json"]["schema"]["$ref"],
        "#/components/schemas/SubmitJob"
    );
    for status in ["201", "200", "409", "422"] {
        assert!(submit["responses"][status].is_object(), "submit {status}");
    }
    let job = &doc["components"]["schemas"]["JobView"]["properties"];
    for field in ["id", "state", "waiting", "parent", "children", "history"] {
        assert!(job[field].is_object(), "JobView.{field}");
    }
    assert!(doc["components"]["schemas"]["ErrorDetail"]["properties"]["field"].is_object());
}
