//! Which peer booked what, so that a peer's bookings can go with the peer: when its link
//! has been down longer than the silence bound, when it is deregistered, or when its
//! endpoint starts speaking with another router id (it restarted, and its old bookings
//! died with its old process). Dynamo keeps them until they expire by age (300 s).

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

/// The most peer bookings tracked at once (beyond it, a booking is applied but not
/// tracked: it can still only expire by age).
pub const MAX_TRACKED_BOOKINGS: usize = 1 << 20;

/// A peer booking's owner, per router id.
#[derive(Debug, Default)]
pub(crate) struct PeerBook {
    routers: HashMap<u64, Router>,
    /// The router id an endpoint speaks with now.
    by_endpoint: HashMap<String, u64>,
    /// Which router booked each id.
    owner: HashMap<String, u64>,
}

#[derive(Debug)]
struct Router {
    endpoint: String,
    ids: HashSet<String>,
    /// Since when its endpoint's link has been down (or it was deregistered).
    down_since: Option<Instant>,
}

impl PeerBook {
    /// A message of `router` arrived on `endpoint`: the ids of the router that spoke
    /// there before, if it was another one (that peer restarted: its bookings are gone).
    pub(crate) fn heard(&mut self, router: u64, endpoint: &str) -> Vec<String> {
        let prev = self.by_endpoint.insert(endpoint.to_string(), router);
        let r = self.routers.entry(router).or_insert_with(|| Router {
            endpoint: endpoint.to_string(),
            ids: HashSet::new(),
            down_since: None,
        });
        r.endpoint = endpoint.to_string();
        r.down_since = None;
        match prev {
            Some(old) if old != router => self.forget_router(old),
            _ => Vec::new(),
        }
    }

    /// `router` booked `id` (applied here).
    pub(crate) fn booked(&mut self, router: u64, id: &str) {
        if self.owner.len() >= MAX_TRACKED_BOOKINGS {
            return;
        }
        if let Some(r) = self.routers.get_mut(&router) {
            r.ids.insert(id.to_string());
            self.owner.insert(id.to_string(), router);
        }
    }

    /// `id` ended (freed by anyone).
    pub(crate) fn ended(&mut self, id: &str) {
        if let Some(router) = self.owner.remove(id) {
            if let Some(r) = self.routers.get_mut(&router) {
                r.ids.remove(id);
            }
        }
    }

    /// The routers whose endpoint `is_up` says is down for `bound` or more (or gone),
    /// forgotten with their ids, which are returned to expire.
    pub(crate) fn silent(
        &mut self,
        now: Instant,
        bound: Duration,
        is_up: impl Fn(&str) -> Option<bool>,
    ) -> Vec<String> {
        let mut gone = Vec::new();
        for (&id, r) in self.routers.iter_mut() {
            match is_up(&r.endpoint) {
                Some(true) => r.down_since = None,
                // Deregistered: at once.
                None => gone.push(id),
                Some(false) => {
                    let since = *r.down_since.get_or_insert(now);
                    if now.duration_since(since) >= bound {
                        gone.push(id);
                    }
                }
            }
        }
        gone.into_iter()
            .flat_map(|id| self.forget_router(id))
            .collect()
    }

    fn forget_router(&mut self, router: u64) -> Vec<String> {
        let Some(r) = self.routers.remove(&router) else {
            return Vec::new();
        };
        if self.by_endpoint.get(&r.endpoint) == Some(&router) {
            self.by_endpoint.remove(&r.endpoint);
        }
        for id in &r.ids {
            self.owner.remove(id);
        }
        r.ids.into_iter().collect()
    }

    /// Peer bookings tracked now.
    #[cfg(test)]
    pub(crate) fn tracked(&self) -> usize {
        self.owner.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_restarted_peer_s_old_bookings_go() {
        let mut b = PeerBook::default();
        assert!(b.heard(1, "tcp://a:1").is_empty());
        b.booked(1, "x");
        b.booked(1, "y");
        b.ended("y");
        assert!(
            b.heard(1, "tcp://a:1").is_empty(),
            "the same router: nothing"
        );
        assert_eq!(b.heard(2, "tcp://a:1"), vec!["x".to_string()]);
        assert_eq!(b.tracked(), 0);
    }

    #[test]
    fn a_silent_or_deregistered_peer_s_bookings_go_after_the_bound() {
        let mut b = PeerBook::default();
        b.heard(1, "tcp://a:1");
        b.heard(2, "tcp://b:1");
        b.booked(1, "a1");
        b.booked(2, "b1");
        let t0 = Instant::now();
        let bound = Duration::from_secs(30);
        let down_a = |e: &str| Some(e != "tcp://a:1");
        assert!(
            b.silent(t0, bound, down_a).is_empty(),
            "down, not yet for long"
        );
        assert!(b
            .silent(t0 + Duration::from_secs(29), bound, down_a)
            .is_empty());
        assert_eq!(b.silent(t0 + bound, bound, down_a), vec!["a1".to_string()]);
        // Back up: the clock restarts.
        let gone_b = |e: &str| if e == "tcp://b:1" { None } else { Some(true) };
        assert_eq!(b.silent(t0 + bound, bound, gone_b), vec!["b1".to_string()]);
        assert_eq!(b.tracked(), 0);
    }
}
