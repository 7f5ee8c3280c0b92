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

/// What OpenAPI 3.1 and client generators need (the document itself is
/// checked by openapi-spec-validator in CI, `scripts/fuzz-api`): every
/// response described; no field with a server default required; with a
/// registry, each workflow's request a named component, chosen by a
/// discriminator on `workflow`.
#[test]
fn every_response_is_described_defaults_are_optional_and_variants_are_named() {
    let mut registry = onceflow_engine::Registry::new();
    registry.register(Named::<0>).register(Named::<1>);
    for doc in [
        onceflow_engine::api::openapi::document(),
        onceflow_engine::api::openapi::document_for(&registry),
    ] {
        let mut responses = 0;
        for (path, item) in doc["paths"].as_object().unwrap() {
            for (method, op) in item.as_object().unwrap() {
                for (code, r) in op["responses"].as_object().into_iter().flatten() {
                    responses += 1;
                    assert!(
                        r["description"].as_str().is_some_and(|d| !d.is_empty()),
                        "{method} {path} {code} has no description"
                    );
                }
            }
        }
        assert!(responses > 100, "{responses} responses checked");
        fn walk(v: &serde_json::Value, at: &str) {
            if let Some(map) = v.as_object() {
                if let (Some(props), Some(required)) = (
                    map.get("properties").and_then(|p| p.as_object()),
                    map.get("required").and_then(|r| r.as_array()),
                ) {
                    for r in required.iter().filter_map(|r| r.as_str()) {
                        assert!(
                            props.get(r).is_none_or(|p| !p["description"]
                                .as_str()
                                .unwrap_or("")
                                .contains("Default: ")),
                            "{at}: {r} has a default but is required"
                        );
                    }
                }
                assert!(
                    !(map.contains_key("type") && map.contains_key("default")),
                    "{at}: a default stated as `default`, which generators type as always present"
                );
                for (k, v) in map {
                    walk(v, &format!("{at}/{k}"));
                }
            } else if let Some(items) = v.as_array() {
                items.iter().for_each(|v| walk(v, at));
            }
        }
        walk(&doc, "");
    }
    let doc = onceflow_engine::api::openapi::document_for(&registry);
    let input = &doc["components"]["schemas"]["SubmitJob_completion"]["properties"]["input"];
    assert!(
        input["properties"]["stream"]["description"]
            .as_str()
            .is_some_and(|d| d.contains("Default: `false`")),
        "a default is said in the description: {input}"
    );
    assert!(
        !input["required"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r == "stream"),
        "a defaulted field is optional: {input}"
    );
    let payload = &doc["components"]["schemas"]["SignalBody"]["properties"]["payload"];
    assert_eq!(
        payload["additionalProperties"], true,
        "an object without properties is open: {payload}"
    );
    let submit = &doc["components"]["schemas"]["SubmitJob"];
    assert_eq!(submit["discriminator"]["propertyName"], "workflow");
    for name in ["completion", "agent"] {
        let reference = format!("#/components/schemas/SubmitJob_{name}");
        assert_eq!(submit["discriminator"]["mapping"][name], reference.as_str());
        let variant = &doc["components"]["schemas"][format!("SubmitJob_{name}")];
        assert_eq!(variant["properties"]["workflow"]["const"], name);
        assert!(
            variant["required"]
                .as_array()
                .unwrap()
                .iter()
                .any(|r| r == "workflow"),
            "the discriminator is required in {name}"
        );
    }
}

/// A workflow whose input schema has a field with a default: `completion`
/// (0) or `agent` (1), as far as the document can tell.
struct Named<const N: u8>;

impl<const N: u8> onceflow_engine::Workflow for Named<N> {
    const NAME: &'static str = if N == 0 { "completion" } else { "agent" };
    type Input = serde_json::Value;
    type Output = serde_json::Value;

    fn input_schema() -> Option<serde_json::Value> {
        Some(serde_json::json!({
            "type": "object",
            "properties": { "model": { "type": "string" }, "stream": { "type": "boolean", "default": false } },
            "required": ["model", "stream"],
        }))
    }

    async fn run(
        &self,
        _: &mut onceflow_engine::Context,
        input: serde_json::Value,
    ) -> Result<serde_json::Value, onceflow_engine::StepError> {
        Ok(input)
    }
}

/// Every link names an operation of the document and fills its `id`
/// parameter from the answer, and a submit links to get, signal and
/// cancel; a schedule's creation to get, pause, resume and delete.
#[test]
fn links_chain_a_submit_and_a_schedule_to_operations_that_exist() {
    let doc = onceflow_engine::api::openapi::document();
    let mut operations = std::collections::BTreeMap::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            if let Some(id) = op["operationId"].as_str() {
                operations.insert(id.to_owned(), (path.clone(), method.clone()));
            }
        }
    }
    let mut linked = std::collections::BTreeSet::new();
    for item in doc["paths"].as_object().unwrap().values() {
        for op in item.as_object().unwrap().values() {
            for response in op["responses"]
                .as_object()
                .into_iter()
                .flat_map(|r| r.values())
            {
                for (name, link) in response["links"].as_object().into_iter().flatten() {
                    let target = link["operationId"].as_str().unwrap();
                    let (path, _) = operations
                        .get(target)
                        .unwrap_or_else(|| panic!("link {name} names no operation"));
                    assert!(path.contains("{id}"), "{target} takes an id");
                    assert_eq!(link["parameters"]["id"], "$response.body#/id");
                    linked.insert(target.to_owned());
                }
            }
        }
    }
    for op in [
        "get_job",
        "signal",
        "cancel",
        "get_schedule",
        "pause_schedule",
        "resume_schedule",
        "delete_schedule",
    ] {
        assert!(linked.contains(op), "nothing links to {op}: {linked:?}");
    }
}
