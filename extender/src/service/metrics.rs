//! Prometheus metrics (OpenMetrics text at `/metrics`).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Labels of one request.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VerbOutcome {
    /// filter, prioritize, bind, preempt.
    pub verb: &'static str,
    /// ok, error, bad_request.
    pub outcome: &'static str,
}

/// Label of one verb.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Verb {
    /// filter, prioritize, bind, preempt.
    pub verb: &'static str,
}

/// The extender's metrics.
pub struct Metrics {
    registry: Registry,
    /// Requests by verb and outcome.
    pub requests: Family<VerbOutcome, Counter>,
    /// Request latency by verb.
    pub latency: Family<Verb, Histogram>,
    /// 1 while this replica leads.
    pub leader: Gauge,
    /// Nodes known.
    pub nodes: Gauge,
    /// Pods holding resources (bound or reserved).
    pub bookings: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("tessera_extender");
        let requests = Family::<VerbOutcome, Counter>::default();
        let latency =
            Family::<Verb, Histogram>::new_with_constructor(|| Histogram::new(exponential_buckets(0.0001, 2.0, 16)));
        let (leader, nodes, bookings) = (Gauge::default(), Gauge::default(), Gauge::default());
        registry.register("requests", "Extender requests by verb and outcome", requests.clone());
        registry.register("request_duration_seconds", "Extender request latency", latency.clone());
        registry.register("leader", "1 while this replica is the leader", leader.clone());
        registry.register("nodes", "Nodes known to the extender", nodes.clone());
        registry.register(
            "bookings",
            "Pods holding node resources (bound or reserved)",
            bookings.clone(),
        );
        Self {
            registry,
            requests,
            latency,
            leader,
            nodes,
            bookings,
        }
    }
}

impl Metrics {
    /// Records one request.
    pub fn observe(&self, verb: &'static str, outcome: &'static str, seconds: f64) {
        self.requests.get_or_create(&VerbOutcome { verb, outcome }).inc();
        self.latency.get_or_create(&Verb { verb }).observe(seconds);
    }

    /// The OpenMetrics text.
    pub fn render(&self) -> String {
        let mut s = String::new();
        prometheus_client::encoding::text::encode(&mut s, &self.registry).expect("writing to a String");
        s
    }
}
