//! A publisher connection's subscriptions: prefixes with a count each (libzmq counts
//! repeated subscribes; each CANCEL takes one away), bounded in number and length.

use bytes::Bytes;

/// Why a subscription was not recorded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refused {
    TooLong,
    TooMany,
}

#[derive(Debug, Default)]
pub(crate) struct Subscriptions {
    entries: Vec<(Bytes, u32)>,
}

impl Subscriptions {
    pub(crate) fn subscribe(
        &mut self,
        topic: Bytes,
        max: usize,
        max_len: usize,
    ) -> Result<(), Refused> {
        if topic.len() > max_len {
            return Err(Refused::TooLong);
        }
        if let Some(e) = self.entries.iter_mut().find(|(t, _)| *t == topic) {
            e.1 = e.1.saturating_add(1);
            return Ok(());
        }
        if self.entries.len() >= max {
            return Err(Refused::TooMany);
        }
        self.entries.push((topic, 1));
        Ok(())
    }

    /// Takes one subscription to `topic` away; unknown topics are ignored.
    pub(crate) fn cancel(&mut self, topic: &[u8]) {
        if let Some(i) = self.entries.iter().position(|(t, _)| t == topic) {
            self.entries[i].1 -= 1;
            if self.entries[i].1 == 0 {
                self.entries.swap_remove(i);
            }
        }
    }

    /// ZMQ's prefix match: an empty subscription matches everything.
    pub(crate) fn matches(&self, topic: &[u8]) -> bool {
        self.entries.iter().any(|(t, _)| topic.starts_with(t))
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_counts_and_bounds() {
        let mut s = Subscriptions::default();
        assert!(!s.matches(b"a"));
        s.subscribe(Bytes::from_static(b"dyn"), 2, 8).unwrap();
        s.subscribe(Bytes::from_static(b"dyn"), 2, 8).unwrap();
        assert!(s.matches(b"dynamo.slot-tracker.v1"));
        assert!(!s.matches(b"dy"));
        s.cancel(b"dyn");
        assert!(s.matches(b"dynamo"), "second subscribe still holds");
        s.cancel(b"dyn");
        assert!(!s.matches(b"dynamo"));
        s.cancel(b"never");
        assert_eq!(
            s.subscribe(Bytes::from_static(b"123456789"), 2, 8),
            Err(Refused::TooLong)
        );
        s.subscribe(Bytes::from_static(b"a"), 2, 8).unwrap();
        s.subscribe(Bytes::from_static(b"b"), 2, 8).unwrap();
        assert_eq!(
            s.subscribe(Bytes::from_static(b"c"), 2, 8),
            Err(Refused::TooMany)
        );
        assert_eq!(s.len(), 2);
        s.subscribe(Bytes::new(), 3, 8).unwrap();
        assert!(s.matches(b"anything"));
    }
}
