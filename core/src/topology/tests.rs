use super::*;
use crate::inventory::{FixtureSource, InventorySource, NodeInventory};

fn inventory(name: &str) -> NodeInventory {
    FixtureSource::new(name).discover().unwrap()
}

/// The set `choose_set` gives for `want` of `idle` on a fixture, by the same link rule the
/// engine and the device plugin use.
fn choose(
    inv: &NodeInventory,
    idle: &[usize],
    want: usize,
    require: Option<LinkRequirement>,
) -> Result<CardSet, String> {
    choose_set(|a, b| inv.link(a, b), idle, want, require)
}

fn all(n: usize) -> Vec<usize> {
    (0..n).collect()
}

fn without(n: usize, taken: &[usize]) -> Vec<usize> {
    (0..n).filter(|i| !taken.contains(i)).collect()
}

#[test]
fn links_parse_print_and_rank() {
    for (text, link) in [
        ("NV18", Link::NvLink(18)),
        ("pix", Link::Pix),
        ("PXB", Link::Pxb),
        ("PHB", Link::Phb),
        ("NODE", Link::Node),
        ("SYS", Link::Sys),
    ] {
        assert_eq!(text.parse::<Link>(), Ok(link));
        assert_eq!(link.to_string().parse::<Link>(), Ok(link));
    }
    assert!("NV0".parse::<Link>().unwrap_err().contains("\"NV0\""));
    assert!("QPI".parse::<Link>().unwrap_err().contains("\"QPI\""));
    let order = [Link::NvLink(1), Link::Pix, Link::Pxb, Link::Phb, Link::Node, Link::Sys];
    assert!(order.windows(2).all(|w| w[0].cost() < w[1].cost()));
    assert_eq!(Link::from_numa(Some(0), Some(0)), Some(Link::Node));
    assert_eq!(Link::from_numa(Some(0), Some(1)), Some(Link::Sys));
    assert_eq!(Link::from_numa(None, Some(1)), None);
}

#[test]
fn the_matrix_is_checked_and_round_trips() {
    let t = GpuTopology::from_rows(&["X NV4 PIX", "NV4 X SYS", "PIX SYS X"]).unwrap();
    assert_eq!(t.link(0, 1), Some(Link::NvLink(4)));
    assert_eq!(t.link(2, 1), Some(Link::Sys));
    assert_eq!(t.link(1, 1), None);
    let json = serde_json::to_string(&t).unwrap();
    assert_eq!(json, r#"{"version":1,"matrix":["X NV4 PIX","NV4 X SYS","PIX SYS X"]}"#);
    assert_eq!(serde_json::from_str::<GpuTopology>(&json).unwrap(), t);
    for (rows, says) in [
        (
            vec!["X NV4", "PIX X"],
            "row 0 column 1 is NV4 but row 1 column 0 is PIX",
        ),
        (vec!["X NV4", "NV4"], "row 1 \"NV4\" has 1 cells"),
        (vec!["NV4 X", "X NV4"], "row 0 column 0: \"NV4\" on the diagonal"),
        (vec!["X QPI", "QPI X"], "row 0 column 1: \"QPI\" is not a link"),
    ] {
        let e = GpuTopology::from_rows(&rows).unwrap_err();
        assert!(e.contains(says), "{e}");
    }
    let big: Vec<String> = (0..=MAX_TOPOLOGY_GPUS).map(|_| String::new()).collect();
    assert!(GpuTopology::from_rows(&big).unwrap_err().contains("more than the 64"));
    // A version this build does not know: an error when read strictly, absent when lenient.
    let v2 = r#"{"version":2,"matrix":["X"]}"#;
    assert!(
        serde_json::from_str::<GpuTopology>(v2)
            .unwrap_err()
            .to_string()
            .contains("version 2")
    );
    #[derive(serde::Deserialize)]
    struct Holder {
        #[serde(default, deserialize_with = "deserialize_lenient")]
        t: Option<GpuTopology>,
    }
    let h: Holder = serde_json::from_str(&format!(r#"{{"t":{v2}}}"#)).unwrap();
    assert_eq!(h.t, None);
}

#[test]
fn requirements_parse_and_admit() {
    let r: LinkRequirement = "pcie-switch".parse().unwrap();
    assert!(r.admits(Link::NvLink(2)) && r.admits(Link::Pxb) && !r.admits(Link::Phb));
    assert!(LinkRequirement::Numa.admits(Link::Node) && !LinkRequirement::Numa.admits(Link::Sys));
    assert!(!LinkRequirement::Nvlink.admits(Link::Pix));
    assert!("fast".parse::<LinkRequirement>().unwrap_err().contains("\"fast\""));
}

/// The choices on every fixture with a topology, from an idle node and after some cards went.
#[test]
fn the_set_choice_on_each_fixture() {
    /// (fixture, cards already taken, want, expected set, its worst link)
    type Row<'a> = (&'a str, &'a [usize], usize, &'a [usize], Option<Link>);
    let table: &[Row] = &[
        // NVSwitch: every pair equal, so the lowest cards.
        ("h100-nvswitch", &[], 2, &[0, 1], Some(Link::NvLink(18))),
        ("h100-nvswitch", &[0, 1], 4, &[2, 3, 4, 5], Some(Link::NvLink(18))),
        (
            "h100-nvswitch",
            &[],
            8,
            &[0, 1, 2, 3, 4, 5, 6, 7],
            Some(Link::NvLink(18)),
        ),
        // Bridged pairs: a bridged pair; the next pair on the same NUMA node; four cards stay
        // on one NUMA node; a single card breaks a pair that is already broken.
        ("a100-nvlink-pairs", &[], 2, &[0, 1], Some(Link::NvLink(12))),
        ("a100-nvlink-pairs", &[0, 1], 2, &[2, 3], Some(Link::NvLink(12))),
        ("a100-nvlink-pairs", &[0, 1, 2, 3], 4, &[4, 5, 6, 7], Some(Link::Node)),
        ("a100-nvlink-pairs", &[], 4, &[0, 1, 2, 3], Some(Link::Node)),
        ("a100-nvlink-pairs", &[0], 1, &[1], None),
        ("a100-nvlink-pairs", &[0, 2], 2, &[4, 5], Some(Link::NvLink(12))),
        ("a100-nvlink-pairs", &[0, 2, 4, 6], 2, &[1, 3], Some(Link::Node)),
        ("a100-nvlink-pairs", &[0, 2, 4], 3, &[5, 6, 7], Some(Link::Node)),
        // Two PCIe switches: a pair under one switch; a single card leaves a switch whole.
        ("l40s-pcie-switches", &[], 2, &[0, 1], Some(Link::Pix)),
        ("l40s-pcie-switches", &[0], 2, &[2, 3], Some(Link::Pix)),
        ("l40s-pcie-switches", &[2], 1, &[3], None),
        ("l40s-pcie-switches", &[], 3, &[0, 1, 2], Some(Link::Phb)),
        // No matrix, NUMA nodes only (h100x8: 0-3 and 4-7): one NUMA node, the fuller one.
        ("h100x8", &[], 4, &[0, 1, 2, 3], Some(Link::Node)),
        ("h100x8", &[0], 2, &[1, 2], Some(Link::Node)),
        ("h100x8", &[0, 4, 5], 3, &[1, 2, 3], Some(Link::Node)),
        ("h100x8", &[0, 1, 2], 2, &[4, 5], Some(Link::Node)),
    ];
    let mut failures = Vec::new();
    for &(fixture, taken, want, expected, worst) in table {
        let inv = inventory(fixture);
        let got = choose(&inv, &without(inv.gpus.len(), taken), want, None).unwrap();
        if got.cards != expected || got.worst != worst {
            failures.push(format!(
                "{fixture} taken {taken:?} want {want}: got {:?} ({:?}), expected {expected:?} ({worst:?})",
                got.cards, got.worst
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn requirements_rule_sets_out_and_say_what_the_best_had() {
    let pairs = inventory("a100-nvlink-pairs");
    let r = Some(LinkRequirement::Nvlink);
    assert_eq!(choose(&pairs, &all(8), 2, r).unwrap().cards, [0, 1]);
    // Cards 1 and 2 idle only: no bridged pair left.
    let e = choose(&pairs, &[1, 2, 5], 2, r).unwrap_err();
    assert_eq!(
        e,
        "no 2 idle GPU(s) connected as tessera.io/gpu-link=nvlink requires (the best set's worst link is NODE)"
    );
    assert!(choose(&pairs, &all(8), 4, r).is_err(), "no four cards are all bridged");
    assert_eq!(
        choose(&pairs, &[0, 2, 4, 6, 7], 3, Some(LinkRequirement::Numa))
            .unwrap()
            .cards,
        [4, 6, 7]
    );
    // Without a matrix only NUMA can be judged.
    let numa_only = inventory("h100x8");
    assert!(choose(&numa_only, &all(8), 4, Some(LinkRequirement::Numa)).is_ok());
    let e = choose(&numa_only, &all(8), 2, Some(LinkRequirement::PcieSwitch)).unwrap_err();
    assert!(e.ends_with("worst link is NODE)"), "{e}");
    // Nothing published: the lowest cards, and every requirement fails as unknown.
    let none = |_: usize, _: usize| None;
    assert_eq!(choose_set(none, &[5, 3, 9], 2, None).unwrap().cards, [3, 5]);
    assert!(
        choose_set(none, &[5, 3, 9], 2, Some(LinkRequirement::Numa))
            .unwrap_err()
            .ends_with("is unknown)")
    );
    assert_eq!(
        choose_set(none, &[1], 2, None).unwrap_err(),
        "needs 2 idle whole GPU(s), 1 idle"
    );
}

/// Beyond what is tried exhaustively (16 cards, 8 wanted: 12,870 sets) sets are grown greedily:
/// on two NVSwitch islands of eight, an 8-card container gets one island, the one a single
/// busy card has not broken.
#[test]
fn large_nodes_are_chosen_greedily_and_still_well() {
    let islands = GpuTopology::new(16, |a, b| if a / 8 == b / 8 { Link::NvLink(18) } else { Link::Sys }).unwrap();
    let link = |a: usize, b: usize| islands.link(a, b);
    assert_eq!(choose_set(link, &all(16), 8, None).unwrap().cards, all(8));
    let set = choose_set(link, &without(16, &[3]), 8, None).unwrap();
    assert_eq!(set.cards, (8..16).collect::<Vec<_>>());
    assert_eq!(set.worst, Some(Link::NvLink(18)));
    let set = choose_set(link, &without(16, &[3, 12]), 8, Some(LinkRequirement::Nvlink));
    assert!(set.is_err(), "{set:?}");
}
