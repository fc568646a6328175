//! The HTTP face: `<prefix>/{filter,prioritize,bind,preempt}`, `/healthz`, `/readyz`,
//! `/metrics`. Bodies are parsed here so that any malformed or oversized request gets a JSON
//! error (`{"Error": ...}`) with a 4xx status, never a panic.

use std::sync::Arc;
use std::time::Instant;

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::{Deserialize, Serialize};

use super::Service;
use super::bind::{self, BindError};
use super::cluster::scale_scores;
use super::scores::Kept;
use super::wire::{
    ErrorReply, ExtenderArgs, ExtenderBindingArgs, ExtenderBindingResult, ExtenderPreemptionArgs,
    ExtenderPreemptionResult, FilterReply, NodeList, host_scores_json,
};

type Shared = Arc<Service>;

fn json<T: Serialize>(status: StatusCode, body: &T) -> Response {
    json_bytes(status, serde_json::to_vec(body).expect("replies serialize").into())
}

/// A reply of JSON already written.
fn json_bytes(status: StatusCode, bytes: Bytes) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], bytes).into_response()
}

fn error(status: StatusCode, msg: impl Into<String>) -> Response {
    json(status, &ErrorReply { error: msg.into() })
}

/// The body, or the status (413 when too large) and message for a JSON error.
fn body_of(body: Result<Bytes, BytesRejection>) -> Result<Bytes, (StatusCode, String)> {
    body.map_err(|r| (r.status(), r.body_text()))
}

/// Parses a body (borrowing from it where the type does); on failure a 400 and the message.
fn parse<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, (StatusCode, String)> {
    serde_json::from_slice(body).map_err(|e| (StatusCode::BAD_REQUEST, format!("malformed request: {e}")))
}

/// Parses a body into an owned value.
fn parse_owned<T: serde::de::DeserializeOwned>(body: Result<Bytes, BytesRejection>) -> Result<T, (StatusCode, String)> {
    parse(&body_of(body)?)
}

/// The router for `svc`, verbs under `prefix` (e.g. `/tessera`). With `verified_clients_only`
/// the verbs answer only requests whose connection presented a client certificate the client
/// CA signed (the scheduler's); health, readiness and metrics answer anyone.
pub fn router(svc: Shared, prefix: &str, body_limit: usize, verified_clients_only: bool) -> Router {
    let prefix = prefix.trim_end_matches('/');
    let mut verbs = Router::new()
        .route(
            &format!("{prefix}/filter"),
            post(filter).layer(axum::middleware::from_fn(wake_engine)),
        )
        .route(&format!("{prefix}/prioritize"), post(prioritize))
        .route(&format!("{prefix}/bind"), post(bind))
        .route(&format!("{prefix}/preempt"), post(preempt));
    if verified_clients_only {
        verbs = verbs.route_layer(axum::middleware::from_fn(only_verified_clients));
    }
    Router::new()
        .merge(verbs)
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/syncedz", get(syncedz))
        .route("/metrics", get(metrics))
        .layer(DefaultBodyLimit::max(body_limit))
        .with_state(svc)
}

/// Wakes the engine's helper threads as a filter's request comes in, to wait while it is read
/// and parsed for the evaluation that follows (a parked thread can take longer to wake than
/// the evaluation takes: see `tessera_core::placement::wake_helpers`).
async fn wake_engine(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let _woken = tessera_core::placement::wake_helpers();
    next.run(req).await
}

/// Lets a request through only when its connection presented a verified client certificate.
async fn only_verified_clients(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    match req.extensions().get::<super::tls::ClientCert>() {
        Some(super::tls::ClientCert(true)) => next.run(req).await,
        _ => error(
            StatusCode::FORBIDDEN,
            "the extender's verbs answer only the scheduler: its client certificate is required",
        ),
    }
}

async fn readyz(State(svc): State<Shared>) -> Response {
    match (svc.cluster.synced(), svc.is_leader()) {
        (true, true) => (StatusCode::OK, "ok").into_response(),
        (false, _) => (StatusCode::SERVICE_UNAVAILABLE, "reading the cluster").into_response(),
        (true, false) => (StatusCode::SERVICE_UNAVAILABLE, "not the leader").into_response(),
    }
}

/// The pod's readiness: the cluster has been read. Leader or not, so that rollouts of the
/// Deployment complete; the Service sends traffic to the leader by its role label.
async fn syncedz(State(svc): State<Shared>) -> Response {
    if svc.cluster.synced() {
        (StatusCode::OK, "ok").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "reading the cluster").into_response()
    }
}

async fn metrics(State(svc): State<Shared>) -> Response {
    let (nodes, bookings) = svc.cluster.counts();
    svc.metrics.nodes.set(nodes as i64);
    svc.metrics.bookings.set(bookings as i64);
    svc.metrics.leader.set(i64::from(svc.is_leader()));
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        svc.metrics.render(),
    )
        .into_response()
}

/// Answers a verb and records its metrics.
fn timed(svc: &Service, verb: &'static str, start: Instant, r: Response) -> Response {
    let outcome = match r.status() {
        s if s.is_success() => "ok",
        s if s.is_client_error() => "bad_request",
        _ => "error",
    };
    svc.metrics.observe(verb, outcome, start.elapsed().as_secs_f64());
    r
}

/// What a verb leaves to do once its answer is out: the prioritize reply of the scores a
/// filter kept, and the engine's memos.
#[derive(Default)]
pub struct Afterwards {
    kept: Option<Arc<Kept>>,
    settle: bool,
}

impl Afterwards {
    /// Does it on a task of its own, where there is anything to do.
    fn spawn(self, svc: &Shared) {
        if self.kept.is_none() && !self.settle {
            return;
        }
        let svc = svc.clone();
        tokio::spawn(async move {
            // The reply first: the scheduler's prioritize waits for it.
            if let Some(kept) = self.kept {
                kept.reply();
            }
            if self.settle {
                svc.cluster.settle();
            }
        });
    }
}

/// The filter verdict, in the shape the request came in, and what is left to do once it is
/// out: among it, the scores kept for the prioritize after it (where they stand until the
/// cluster changes), which must be handed off before the answer goes.
pub fn filter_reply<'a>(svc: &Service, args: &'a ExtenderArgs<'_>) -> (FilterReply<'a>, Afterwards) {
    let candidates = args.candidates();
    let mut reply = FilterReply::default();
    let mut after = Afterwards::default();
    let fitting: Vec<&str> = match svc.cluster.ask(&args.pod) {
        Err(e) => {
            // Never schedulable as written: say why on every node.
            let msg: Arc<str> = format!("invalid Tessera request: {e}").into();
            reply.failed_and_unresolvable_nodes = candidates.iter().map(|&n| (n, msg.clone())).collect();
            Vec::new()
        }
        // Not ours: pass every node through without touching the ledger.
        Ok(ask) if !ask.demand.wants_cards() => candidates,
        Ok(_) if !svc.cluster.synced() => {
            reply.error = "the Tessera extender is still reading the cluster".into();
            return (reply, after);
        }
        Ok(ask) => {
            let out = svc.cluster.filter(&ask, &candidates);
            after.kept = out.stamp.map(|stamp| Arc::new(Kept::new(&ask, stamp, &out.fits)));
            after.settle = out.unsettled;
            reply.failed_nodes = out.failed;
            reply.failed_and_unresolvable_nodes = out.unresolvable;
            out.fits.into_iter().map(|(n, _)| n).collect()
        }
    };
    match &args.nodes {
        Some(list) if args.node_names.is_none() => {
            let keep: std::collections::HashSet<&str> = fitting.into_iter().collect();
            reply.nodes = Some(NodeList {
                metadata: list.metadata.clone(),
                items: list
                    .items
                    .iter()
                    .filter(|n| n.metadata.name.as_deref().is_some_and(|x| keep.contains(x)))
                    .cloned()
                    .collect(),
            });
        }
        _ => reply.node_names = Some(fitting),
    }
    (reply, after)
}

async fn filter(State(svc): State<Shared>, body: Result<Bytes, BytesRejection>) -> Response {
    let start = Instant::now();
    let r = match body_of(body) {
        Err((status, msg)) => error(status, msg),
        Ok(bytes) => match parse::<ExtenderArgs>(&bytes) {
            Err((status, msg)) => error(status, msg),
            Ok(args) => {
                let (reply, after) = filter_reply(&svc, &args);
                let r = json_bytes(StatusCode::OK, reply.to_json().into());
                if let Some(kept) = &after.kept {
                    svc.handoff.keep(kept.clone());
                }
                // Done while the scheduler reads the filter's answer.
                after.spawn(&svc);
                r
            }
        },
    };
    timed(&svc, "filter", start, r)
}

/// The prioritize scores (1..=10) of the nodes that fit, as JSON (those scored 0 left out:
/// [`scale_scores`]): the ones the filter of the pod kept for these nodes where nothing has
/// changed since, else worked out now (and then the engine's memos are left to do once the
/// answer is out).
pub fn prioritize_reply(svc: &Service, args: &ExtenderArgs<'_>) -> (Bytes, Afterwards) {
    let ask = match svc.cluster.ask(&args.pod) {
        Ok(a) if a.demand.wants_cards() && svc.cluster.synced() => a,
        // Not ours, invalid or not ready: no opinion.
        _ => return (host_scores_json(&[]).into(), Afterwards::default()),
    };
    let candidates = args.candidates();
    if let Some(kept) = svc.handoff.reply(&ask, &candidates, svc.cluster.stamp()) {
        return (kept, Afterwards::default());
    }
    let out = svc.cluster.filter(&ask, &candidates);
    let after = Afterwards {
        kept: None,
        settle: out.unsettled,
    };
    (host_scores_json(&scale_scores(&out.fits)).into(), after)
}

async fn prioritize(State(svc): State<Shared>, body: Result<Bytes, BytesRejection>) -> Response {
    let start = Instant::now();
    let r = match body_of(body) {
        Err((status, msg)) => error(status, msg),
        Ok(bytes) => match parse::<ExtenderArgs>(&bytes) {
            Err((status, msg)) => error(status, msg),
            Ok(args) => {
                let (reply, after) = prioritize_reply(&svc, &args);
                after.spawn(&svc);
                json_bytes(StatusCode::OK, reply)
            }
        },
    };
    timed(&svc, "prioritize", start, r)
}

async fn bind(State(svc): State<Shared>, body: Result<Bytes, BytesRejection>) -> Response {
    let start = Instant::now();
    let r = match parse_owned::<ExtenderBindingArgs>(body) {
        Err((status, msg)) => error(status, msg),
        // Run to completion even if the scheduler gives up and closes the connection: a bind
        // dropped between reserving and releasing would leak its reservation.
        Ok(args) => match tokio::spawn({
            let svc = svc.clone();
            async move { bind::bind(&svc, &args).await }
        })
        .await
        .unwrap_or_else(|e| Err(BindError::Panicked(e.to_string())))
        {
            Ok(()) => json(StatusCode::OK, &ExtenderBindingResult::default()),
            // The scheduler reads `Error` from a 200; keep the status for metrics only.
            Err(e) => {
                let status = match e {
                    BindError::NotLeader | BindError::NotSynced => StatusCode::SERVICE_UNAVAILABLE,
                    _ => StatusCode::OK,
                };
                let reply = ExtenderBindingResult { error: e.to_string() };
                svc.metrics.observe("bind", "error", start.elapsed().as_secs_f64());
                return json(status, &reply);
            }
        },
    };
    timed(&svc, "bind", start, r)
}

async fn preempt(State(svc): State<Shared>, body: Result<Bytes, BytesRejection>) -> Response {
    let start = Instant::now();
    let r = match parse_owned::<ExtenderPreemptionArgs>(body) {
        Err((status, msg)) => error(status, msg),
        Ok(args) => {
            let candidates = args.candidates();
            let kept = match svc.cluster.ask(&args.pod) {
                Ok(ask) if ask.demand.wants_cards() && svc.cluster.synced() => svc.cluster.preempt(&ask, candidates),
                // Not ours to judge: keep the scheduler's choice.
                _ => candidates,
            };
            json(
                StatusCode::OK,
                &ExtenderPreemptionResult {
                    node_name_to_meta_victims: kept,
                },
            )
        }
    };
    timed(&svc, "preempt", start, r)
}
