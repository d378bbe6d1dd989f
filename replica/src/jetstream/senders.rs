//! The other replicas as this one hears them: each one's incarnation, the last sequence
//! number applied from it, when it was last heard, and the bookings it made here. From
//! these come the three decisions of the JetStream sync: apply an event or not (in order,
//! a repeat, a gap, an old incarnation), whose bookings go when a replica restarts (a new
//! incarnation), and whose go when it falls silent.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

/// The most replicas tracked at once (names come from the network: a bound).
pub(crate) const MAX_SENDERS: usize = 4096;

/// The most peer bookings tracked at once (beyond: applied, not tracked; they still
/// expire by age).
pub(crate) const MAX_TRACKED: usize = 1 << 20;

/// What to do with one event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// The next one (or the first heard of this incarnation): apply it.
    Apply,
    /// Its sequence number was applied already (a replay's overlap): skip it.
    Repeat,
    /// From an incarnation older than the one heard already: skip it.
    Stale,
    /// `missing` events of this incarnation are missing before it: not applied yet.
    Gap { missing: u64 },
    /// Over [`MAX_SENDERS`]: skip it.
    Refused,
}

#[derive(Debug)]
struct Sender {
    incarnation: u64,
    /// The last sequence number applied (`None`: none yet in this incarnation, as after
    /// only a heartbeat: the first event is the baseline).
    last_seq: Option<u64>,
    heard: Instant,
    ids: HashSet<String>,
    /// The stream position of the last event applied from it (a replay after a gap in
    /// its sequence starts after it).
    last_stream_seq: Option<u64>,
}

impl Sender {
    fn new(incarnation: u64, now: Instant) -> Self {
        Self {
            incarnation,
            last_seq: None,
            heard: now,
            ids: HashSet::new(),
            last_stream_seq: None,
        }
    }
}

/// Every other replica heard of.
#[derive(Debug, Default)]
pub(crate) struct Senders {
    senders: HashMap<String, Sender>,
    owner: HashMap<String, String>,
}

impl Senders {
    /// Heard `name` in `incarnation`: the ids of an older incarnation, now gone, and the
    /// sender (`None`: stale, or over the bound).
    fn hear(
        &mut self,
        name: &str,
        incarnation: u64,
        now: Instant,
        gone: &mut Vec<String>,
    ) -> Option<&mut Sender> {
        if !self.senders.contains_key(name) {
            if self.senders.len() >= MAX_SENDERS {
                return None;
            }
            self.senders
                .insert(name.to_string(), Sender::new(incarnation, now));
        }
        let s = self.senders.get_mut(name)?;
        if incarnation < s.incarnation {
            return None;
        }
        if incarnation > s.incarnation {
            let old = std::mem::replace(s, Sender::new(incarnation, now));
            for id in &old.ids {
                self.owner.remove(id);
            }
            gone.extend(old.ids);
        }
        let s = self.senders.get_mut(name)?;
        s.heard = now;
        Some(s)
    }

    /// An event `seq` of `name`'s `incarnation`: what to do with it, and the ids of the
    /// replica's earlier incarnation, to expire (it restarted).
    pub(crate) fn event(
        &mut self,
        name: &str,
        incarnation: u64,
        seq: u64,
        now: Instant,
    ) -> (Verdict, Vec<String>) {
        let mut gone = Vec::new();
        let full = !self.senders.contains_key(name) && self.senders.len() >= MAX_SENDERS;
        let Some(s) = self.hear(name, incarnation, now, &mut gone) else {
            let v = if full {
                Verdict::Refused
            } else {
                Verdict::Stale
            };
            return (v, gone);
        };
        let v = match s.last_seq {
            None => Verdict::Apply,
            Some(last) if seq <= last => Verdict::Repeat,
            Some(last) if seq == last + 1 => Verdict::Apply,
            Some(last) => Verdict::Gap {
                missing: seq - last - 1,
            },
        };
        if v == Verdict::Apply {
            s.last_seq = Some(seq);
        }
        (v, gone)
    }

    /// Takes `seq` of `name` as the next one although events before it are missing (they
    /// are not in the stream: a replay did not bring them).
    pub(crate) fn skip_to(&mut self, name: &str, seq: u64) {
        if let Some(s) = self.senders.get_mut(name) {
            s.last_seq = Some(seq);
        }
    }

    /// The event of `name` just applied was at `stream_seq` in the stream.
    pub(crate) fn applied_at(&mut self, name: &str, stream_seq: u64) {
        if let Some(s) = self.senders.get_mut(name) {
            s.last_stream_seq = Some(stream_seq);
        }
    }

    /// Where a replay for a gap in `name`'s sequence starts after (`None`: nothing of it
    /// applied in this incarnation, nothing to replay from).
    pub(crate) fn replay_from(&self, name: &str) -> Option<u64> {
        self.senders.get(name).and_then(|s| s.last_stream_seq)
    }

    /// A heartbeat of `name`'s `incarnation`: the ids of an earlier incarnation, to expire.
    pub(crate) fn heartbeat(&mut self, name: &str, incarnation: u64, now: Instant) -> Vec<String> {
        let mut gone = Vec::new();
        self.hear(name, incarnation, now, &mut gone);
        gone
    }

    /// The incarnation of `name` heard now.
    pub(crate) fn incarnation(&self, name: &str) -> Option<u64> {
        self.senders.get(name).map(|s| s.incarnation)
    }

    /// `name` booked `id` here.
    pub(crate) fn booked(&mut self, name: &str, id: &str) {
        if self.owner.len() >= MAX_TRACKED {
            return;
        }
        if let Some(s) = self.senders.get_mut(name) {
            s.ids.insert(id.to_string());
            self.owner.insert(id.to_string(), name.to_string());
        }
    }

    /// `id` ended (freed by anyone, or expired here).
    pub(crate) fn ended(&mut self, id: &str) {
        if let Some(name) = self.owner.remove(id) {
            if let Some(s) = self.senders.get_mut(&name) {
                s.ids.remove(id);
            }
        }
    }

    /// Counts everyone as heard now: this replica's own link was down, so their silence
    /// meant nothing.
    pub(crate) fn heard_all(&mut self, now: Instant) {
        for s in self.senders.values_mut() {
            s.heard = now;
        }
    }

    /// The replicas not heard for `bound`, forgotten: their bookings' ids, to expire, and
    /// their names.
    pub(crate) fn silent(&mut self, now: Instant, bound: Duration) -> (Vec<String>, Vec<String>) {
        let names: Vec<String> = self
            .senders
            .iter()
            .filter(|(_, s)| now.saturating_duration_since(s.heard) >= bound)
            .map(|(n, _)| n.clone())
            .collect();
        let mut ids = Vec::new();
        for n in &names {
            if let Some(s) = self.senders.remove(n) {
                for id in &s.ids {
                    self.owner.remove(id);
                }
                ids.extend(s.ids);
            }
        }
        (ids, names)
    }

    /// Replicas heard from now.
    pub(crate) fn len(&self) -> usize {
        self.senders.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_apply_in_order_repeats_skip_and_gaps_are_found() {
        let mut s = Senders::default();
        let t = Instant::now();
        assert_eq!(
            s.event("a", 1, 5, t).0,
            Verdict::Apply,
            "the first is the baseline"
        );
        assert_eq!(s.event("a", 1, 6, t).0, Verdict::Apply);
        assert_eq!(s.event("a", 1, 6, t).0, Verdict::Repeat);
        assert_eq!(s.event("a", 1, 2, t).0, Verdict::Repeat);
        assert_eq!(s.event("a", 1, 9, t).0, Verdict::Gap { missing: 2 });
        assert_eq!(
            s.event("a", 1, 9, t).0,
            Verdict::Gap { missing: 2 },
            "still"
        );
        assert_eq!(
            s.event("a", 1, 7, t).0,
            Verdict::Apply,
            "the replay brings 7"
        );
        s.skip_to("a", 9);
        assert_eq!(s.event("a", 1, 10, t).0, Verdict::Apply);
        assert_eq!(s.event("b", 4, 1, t).0, Verdict::Apply, "senders are apart");
    }

    #[test]
    fn a_new_incarnation_ends_the_old_one_s_bookings_and_old_events_are_stale() {
        let mut s = Senders::default();
        let t = Instant::now();
        s.event("a", 10, 1, t);
        s.booked("a", "x");
        s.event("a", 10, 2, t);
        s.booked("a", "y");
        s.ended("y");
        assert!(s.heartbeat("a", 10, t).is_empty());
        let (v, gone) = s.event("a", 11, 1, t);
        assert_eq!((v, gone), (Verdict::Apply, vec!["x".to_string()]));
        assert_eq!(s.event("a", 10, 3, t).0, Verdict::Stale);
        // A heartbeat of a newer incarnation ends the old one's bookings too.
        s.booked("a", "z");
        assert_eq!(s.heartbeat("a", 12, t), vec!["z".to_string()]);
        assert_eq!(s.event("a", 12, 40, t).0, Verdict::Apply, "baseline again");
        assert!(s.owner.is_empty());
    }

    #[test]
    fn silent_senders_go_after_the_bound_unless_this_link_was_down() {
        let mut s = Senders::default();
        let t0 = Instant::now();
        let bound = Duration::from_secs(5);
        s.event("a", 1, 1, t0);
        s.booked("a", "x");
        s.event("b", 1, 1, t0);
        assert_eq!(s.silent(t0 + Duration::from_secs(4), bound).0.len(), 0);
        s.heard_all(t0 + Duration::from_secs(4));
        assert_eq!(s.silent(t0 + Duration::from_secs(8), bound).0.len(), 0);
        s.heartbeat("b", 1, t0 + Duration::from_secs(8));
        let (ids, names) = s.silent(t0 + Duration::from_secs(9), bound);
        assert_eq!((ids, names), (vec!["x".to_string()], vec!["a".to_string()]));
        assert_eq!(s.len(), 1);
    }
}
