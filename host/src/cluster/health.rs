//! Which nodes the router may send work to.
//!
//! A node is *down* from the moment a connection to it fails, or a probe finds it silent or
//! serving something other than what the cluster agreed on, until a probe finds it answering and
//! agreeing again. The router probes every node each [`PROBE_EVERY`] and picks among the nodes
//! that are up, round-robin; when none of a role is up it tries them anyway (the request then
//! fails with `node_failed`, naming the node).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::watch;

use super::Agreement;
use super::link::{Msg, Transport};
use crate::config::{NodeAddr, Role};
use crate::metrics::Metrics;

/// How often the router asks every node what it serves.
pub const PROBE_EVERY: Duration = Duration::from_secs(1);

/// How long a probe waits for a node's answer.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

struct Node {
    addr: NodeAddr,
    role: Role,
    up: AtomicBool,
}

/// The nodes of one router, each up or down.
pub struct Health {
    nodes: Vec<Node>,
    metrics: Arc<Metrics>,
    transport: Transport,
}

impl Health {
    /// Every node, by address and role, up (the router has just heard from each of them).
    pub fn new(nodes: &[(NodeAddr, Role)], metrics: Arc<Metrics>, transport: Transport) -> Self {
        let nodes: Vec<Node> = nodes
            .iter()
            .map(|(addr, role)| Node {
                addr: addr.clone(),
                role: *role,
                up: AtomicBool::new(true),
            })
            .collect();
        for n in &nodes {
            metrics.node_up(n.role, &n.addr, true);
        }
        Self {
            nodes,
            metrics,
            transport,
        }
    }

    /// The `n`th of `role`'s nodes, counting only those up, skipping `except`; `None` when
    /// every other node of the role is down.
    pub fn pick(&self, role: Role, n: usize, except: &[NodeAddr]) -> Option<NodeAddr> {
        let up: Vec<NodeAddr> = self
            .nodes
            .iter()
            .filter(|x| x.role == role && x.up.load(Ordering::Relaxed) && !except.contains(&x.addr))
            .map(|x| x.addr.clone())
            .collect();
        (!up.is_empty()).then(|| up[n % up.len()].clone())
    }

    /// Marks `addr` up or down, saying so when that changes it.
    pub fn set(&self, addr: &NodeAddr, up: bool, why: &str) {
        let Some(node) = self.nodes.iter().find(|x| x.addr == *addr) else {
            return;
        };
        if node.up.swap(up, Ordering::Relaxed) != up {
            self.metrics.node_up(node.role, addr, up);
            if up {
                tracing::info!("cluster: {} node {addr} is back", node.role);
            } else {
                tracing::warn!("cluster: {} node {addr} is down: {why}", node.role);
            }
        }
    }

    /// Probes every node each [`PROBE_EVERY`] until `closing` is raised: a node is up when it
    /// answers in time, in its configured role, agreeing with `agreed`.
    pub async fn probe(self: Arc<Self>, agreed: Agreement, mut closing: watch::Receiver<bool>) {
        let mut tick = tokio::time::interval(PROBE_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = closing.changed() => return,
            }
            // All at once, so one hung node delays no other's check.
            let mut checks = tokio::task::JoinSet::new();
            for i in 0..self.nodes.len() {
                let (health, agreed) = (self.clone(), agreed.clone());
                checks.spawn(async move { health.check(i, &agreed).await });
            }
            while checks.join_next().await.is_some() {}
        }
    }

    /// Asks the `i`th node what it serves and marks it up or down by its answer.
    async fn check(&self, i: usize, agreed: &Agreement) {
        let node = &self.nodes[i];
        let verdict = match tokio::time::timeout(PROBE_TIMEOUT, self.transport.call(&node.addr, &Msg::Describe)).await {
            Err(_) => Err("it did not answer in time".to_string()),
            Ok(Err(e)) => Err(e.to_string()),
            Ok(Ok(Msg::Info(info))) if info.role != node.role => Err(format!("it is now a {} node", info.role)),
            Ok(Ok(Msg::Info(info))) => agreed.check(&info, &node.addr).map_err(|e| e.to_string()),
            Ok(Ok(_)) => Err("it answered Describe with something else".to_string()),
        };
        match verdict {
            Ok(()) => self.set(&node.addr, true, ""),
            Err(why) => self.set(&node.addr, false, &why),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_round_robin_among_the_nodes_up_and_none_when_all_are_down() {
        let at = |s: &str| NodeAddr::parse(s).unwrap();
        let (a, b, p) = (at("127.0.0.1:1"), at("decode-b.cluster:2"), at("127.0.0.1:3"));
        let nodes = [
            (p.clone(), Role::Prefill),
            (a.clone(), Role::Decode),
            (b.clone(), Role::Decode),
        ];
        let h = Health::new(&nodes, Arc::new(Metrics::default()), Transport::plain());
        let picks: Vec<_> = (0..4).map(|n| h.pick(Role::Decode, n, &[])).collect();
        assert_eq!(
            picks,
            [Some(a.clone()), Some(b.clone()), Some(a.clone()), Some(b.clone())]
        );
        assert_eq!(h.pick(Role::Prefill, 7, &[]), Some(p));
        assert_eq!(
            h.pick(Role::Decode, 0, std::slice::from_ref(&a)),
            Some(b.clone()),
            "a node already tried is skipped"
        );
        h.set(&b, false, "test");
        assert_eq!(
            (0..3).map(|n| h.pick(Role::Decode, n, &[])).collect::<Vec<_>>(),
            vec![Some(a.clone()); 3]
        );
        assert_eq!(h.pick(Role::Decode, 0, std::slice::from_ref(&a)), None);
        h.set(&a, false, "test");
        assert_eq!(h.pick(Role::Decode, 0, &[]), None);
        h.set(&b, true, "");
        assert_eq!(h.pick(Role::Decode, 5, &[]), Some(b));
    }
}
