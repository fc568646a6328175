//! The kinds served by path alone (`/apis/<group>/<version>/[namespaces/<ns>/]<plural>[/<name>
//! [/status]]`, and core/v1 Secrets): list, watch, get, create, replace, merge patch and delete,
//! with the status subresource as the API server keeps it (status written only through
//! `/status`, the rest only without it).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::Value;

use super::{
    ApiError, GENERIC, Inner, Kind, ListQuery, list_or_watch, parse_body, patch_fn, replace_fn, respond, status,
};

/// Where a request goes.
struct Target {
    kind: Kind,
    ns: String,
    name: Option<String>,
    status: bool,
}

fn not_served(path: &str) -> ApiError {
    status(
        StatusCode::NOT_FOUND,
        "NotFound",
        format!("the fake API server does not serve {path}"),
    )
}

fn target(group_version: &str, ns: Option<&str>, rest: &[&str], path: &str) -> Result<Target, ApiError> {
    let (plural, name, sub) = match rest {
        [p] => (*p, None, None),
        [p, n] => (*p, Some(*n), None),
        [p, n, s] => (*p, Some(*n), Some(*s)),
        _ => return Err(not_served(path)),
    };
    let kind = GENERIC
        .iter()
        .find(|(_, gv, pl)| *gv == group_version && *pl == plural)
        .map(|g| g.0)
        .ok_or_else(|| not_served(path))?;
    let misplaced = match (ns.is_some(), kind.namespaced()) {
        // A namespaced kind is listed across namespaces without one; nothing else lacks it.
        (false, true) => name.is_some(),
        (true, false) => true,
        _ => false,
    };
    if misplaced || sub.is_some_and(|s| s != "status" || !kind.has_status()) {
        return Err(not_served(path));
    }
    Ok(Target {
        kind,
        ns: ns.unwrap_or_default().to_string(),
        name: name.map(str::to_string),
        status: sub.is_some(),
    })
}

/// Applies `f` as the subresource rules say: through `/status` only the status changes,
/// otherwise everything but the status.
fn scoped(
    kind: Kind,
    status_only: bool,
    f: impl FnOnce(&mut Value) -> Result<(), ApiError>,
) -> impl FnOnce(&mut Value) -> Result<(), ApiError> {
    move |obj: &mut Value| {
        let before = obj.clone();
        f(obj)?;
        if kind.has_status() {
            if status_only {
                let new_status = obj.get("status").cloned();
                *obj = before;
                match new_status {
                    Some(s) => obj["status"] = s,
                    None => {
                        obj.as_object_mut().map(|o| o.remove("status"));
                    }
                }
            } else {
                match before.get("status") {
                    Some(s) => obj["status"] = s.clone(),
                    None => {
                        obj.as_object_mut().map(|o| o.remove("status"));
                    }
                }
            }
        }
        Ok(())
    }
}

async fn handle(
    inner: Arc<Inner>,
    t: Target,
    method: Method,
    q: ListQuery,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let Target {
        kind,
        ns,
        name,
        status: sub,
    } = t;
    let missing = |n: &str| {
        status(
            StatusCode::NOT_FOUND,
            "NotFound",
            format!("{} {n:?} not found", kind.name().to_lowercase()),
        )
    };
    match (method, name) {
        (Method::GET, None) => {
            let scope = (kind.namespaced() && !ns.is_empty()).then_some(ns);
            list_or_watch(inner, kind, scope, q).await
        }
        (Method::POST, None) if kind.namespaced() && ns.is_empty() => {
            not_served(&format!("POST of a {} without a namespace", kind.name())).into_response()
        }
        (Method::POST, None) => respond(
            parse_body(&body).and_then(|mut v| {
                if kind.has_status() {
                    v.as_object_mut().map(|o| o.remove("status"));
                }
                inner.create(kind, &ns, v)
            }),
            StatusCode::CREATED,
        ),
        (Method::GET, Some(n)) => respond(inner.get(kind, &ns, &n).ok_or_else(|| missing(&n)), StatusCode::OK),
        (Method::PUT, Some(n)) => respond(
            replace_fn(&body).and_then(|f| inner.update(kind, &ns, &n, scoped(kind, sub, f))),
            StatusCode::OK,
        ),
        (Method::PATCH, Some(n)) => respond(
            patch_fn(&headers, &body).and_then(|f| inner.update(kind, &ns, &n, scoped(kind, sub, f))),
            StatusCode::OK,
        ),
        (Method::DELETE, Some(n)) if !sub => respond(inner.delete(kind, &ns, &n), StatusCode::OK),
        (m, _) => status(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            format!("{m} is not served here"),
        )
        .into_response(),
    }
}

/// `/apis/...`.
pub(super) async fn serve(
    State(inner): State<Arc<Inner>>,
    Path(rest): Path<String>,
    method: Method,
    Query(q): Query<ListQuery>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let path = format!("/apis/{rest}");
    let segs: Vec<&str> = rest.split('/').filter(|s| !s.is_empty()).collect();
    let t = match segs.as_slice() {
        [g, v, "namespaces", ns, rest @ ..] if !rest.is_empty() => target(&format!("{g}/{v}"), Some(ns), rest, &path),
        [g, v, rest @ ..] if !rest.is_empty() => target(&format!("{g}/{v}"), None, rest, &path),
        _ => Err(not_served(&path)),
    };
    match t {
        Ok(t) => handle(inner, t, method, q, headers, body).await,
        Err(e) => e.into_response(),
    }
}

/// `/api/v1/namespaces/<ns>/secrets[/<name>]`.
pub(super) async fn serve_secrets(
    State(inner): State<Arc<Inner>>,
    Path(params): Path<Vec<(String, String)>>,
    method: Method,
    Query(q): Query<ListQuery>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let get = |k: &str| params.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    let t = Target {
        kind: Kind::Secret,
        ns: get("ns").unwrap_or_default(),
        name: get("name"),
        status: false,
    };
    handle(inner, t, method, q, headers, body).await
}
