//! Reusing the token ids of text seen before: a conversation resends its whole history
//! each turn, and tokenizing it again is most of a gateway's CPU per request.
//!
//! HuggingFace tokenizers first cut the text at its added tokens (`<|im_start|>`, ...)
//! and tokenize each piece between them on its own. So where a new prompt shares a head
//! with a prompt seen before, up to the start of an added token, the ids of that head are
//! the old prompt's ids up to that token; only the rest, from the token on, is tokenized.
//!
//! That holds when (each is checked, else the place is not used): the token is matched
//! exactly at that place in the old prompt's own encoding (its offsets), it has no
//! `lstrip`/`rstrip`/`single_word` and is not `normalized` (so its match depends only on
//! its own bytes), and the two texts agree a further `margin` bytes past the place (the
//! longest added token: a match starting before the place, or a longer match at it,
//! reads no further). The rest is tokenized starting with the token, so it is never the
//! first piece of its text (a Metaspace "first" prefix is not added again).
//!
//! A sample of the reuses is checked against a full encoding (all of the first
//! `check_first`, then one in `check_every`); one mismatch turns reuse off for the model,
//! counted and logged by the host from [`ReuseStats`].
//!
//! Places are found by a window of text around them (its position and up to
//! [`WINDOW`] bytes before it), then confirmed by comparing the whole head: a collision
//! costs a comparison, never a wrong id.

use std::collections::hash_map::DefaultHasher;
use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex, MutexGuard};

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};
use tokenizers::Encoding;

/// Bytes of text before a place that go into its key.
pub(crate) const WINDOW: usize = 256;
/// Places tried per lookup, from the end of the text.
const TRIES: usize = 32;
/// Places of a text stored as keys, the last ones (a later prompt extends the text).
const KEYS_PER_TEXT: usize = 32;
/// Book-keeping bytes counted per key.
const KEY_BYTES: usize = 48;

/// How much to keep and how often to check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReuseConfig {
    /// Bytes of texts and ids kept (oldest first out); 0 turns reuse off.
    pub capacity_bytes: usize,
    /// Reuses checked against a full encoding at first, every one.
    pub check_first: u64,
    /// After those, one reuse in this many is checked (0: none).
    pub check_every: u64,
}

impl Default for ReuseConfig {
    fn default() -> Self {
        ReuseConfig {
            capacity_bytes: 64 << 20,
            check_first: 32,
            check_every: 256,
        }
    }
}

/// What reuse did, since the tokenizer was loaded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReuseStats {
    /// Texts looked up (those with a place reuse could start at).
    pub lookups: u64,
    /// Lookups that reused a head.
    pub hits: u64,
    /// Token ids taken from texts seen before.
    pub reused_tokens: u64,
    /// Token ids the tokenizer produced (whole texts on a miss, the rest on a hit).
    pub encoded_tokens: u64,
    /// Reuses checked against a full encoding.
    pub checks: u64,
    /// Checks that differed (reuse is then off for the model).
    pub mismatches: u64,
    /// Texts dropped to stay within the capacity.
    pub evictions: u64,
    /// Texts and bytes held now.
    pub texts: u64,
    pub bytes: u64,
    /// Reuse is off (a mismatch, or a tokenizer it cannot serve: truncation, padding).
    pub disabled: bool,
}

/// A text seen before, its ids (no special tokens added) and the places reuse may start.
struct Seen {
    text: Box<str>,
    ids: Box<[u32]>,
    /// (byte offset of an eligible added token, index of its id), ascending.
    places: Vec<(usize, usize)>,
}

impl Seen {
    fn bytes(&self, keys: usize) -> usize {
        self.text.len() + self.ids.len() * 4 + self.places.len() * 16 + keys * KEY_BYTES
    }
}

#[derive(Default)]
struct State {
    keys: HashMap<u64, (Arc<Seen>, usize)>,
    order: VecDeque<(Arc<Seen>, Vec<u64>)>,
    stats: ReuseStats,
}

/// The reuse table of one tokenizer.
pub(crate) struct Reuse {
    config: ReuseConfig,
    /// Finds eligible added tokens in a text.
    finder: AhoCorasick,
    /// Eligible added tokens: id → content length.
    eligible: HashMap<u32, usize>,
    margin: usize,
    state: Mutex<State>,
}

impl Reuse {
    /// The table for `tok`, or `None` when reuse is off or cannot serve it.
    pub(crate) fn new(tok: &tokenizers::Tokenizer, config: ReuseConfig) -> Option<Reuse> {
        if config.capacity_bytes == 0
            || tok.get_truncation().is_some()
            || tok.get_padding().is_some()
        {
            return None;
        }
        let added = tok.get_added_tokens_decoder();
        let margin = added.values().map(|t| t.content.len()).max().unwrap_or(0);
        let mut eligible = HashMap::new();
        let mut patterns = Vec::new();
        for (&id, t) in &added {
            if !t.content.is_empty() && !t.lstrip && !t.rstrip && !t.single_word && !t.normalized {
                eligible.insert(id, t.content.len());
                patterns.push(t.content.clone());
            }
        }
        if patterns.is_empty() {
            return None;
        }
        let finder = AhoCorasickBuilder::new()
            .match_kind(MatchKind::LeftmostLongest)
            .build(&patterns)
            .ok()?;
        Some(Reuse {
            config,
            finder,
            eligible,
            margin,
            state: Mutex::new(State::default()),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves only counters and a table of valid
        // entries: keep using it.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn stats(&self) -> ReuseStats {
        self.lock().stats
    }

    fn key(&self, text: &str, at: usize) -> u64 {
        let mut h = DefaultHasher::new();
        at.hash(&mut h);
        text.as_bytes()[at.saturating_sub(WINDOW)..at + self.margin].hash(&mut h);
        h.finish()
    }

    /// The ids of `text` (no special tokens added), reusing a head seen before where one
    /// matches. `encode` tokenizes a text with offsets (no special tokens added). `None`:
    /// reuse does not serve this text (it is off, or the text has no place a later text
    /// could reuse from); the caller encodes it (without the cost of offsets).
    pub(crate) fn encode<E>(&self, text: &str, encode: E) -> Option<Result<Vec<u32>, String>>
    where
        E: Fn(&str) -> Result<Encoding, String>,
    {
        if self.lock().stats.disabled {
            return None;
        }
        let starts: Vec<usize> = self
            .finder
            .find_iter(text)
            .map(|m| m.start())
            .filter(|&at| at + self.margin <= text.len())
            .collect();
        if starts.is_empty() {
            return None;
        }
        Some(self.encode_at(text, &starts, encode))
    }

    fn encode_at<E>(&self, text: &str, starts: &[usize], encode: E) -> Result<Vec<u32>, String>
    where
        E: Fn(&str) -> Result<Encoding, String>,
    {
        let found = self.find(text, starts);
        let (ids, places, reused) = match found {
            Some((seen, idx)) => {
                let (at, k) = seen.places[idx];
                let rest = encode(&text[at..])?;
                let mut ids = Vec::with_capacity(k + rest.len());
                ids.extend_from_slice(&seen.ids[..k]);
                ids.extend_from_slice(rest.get_ids());
                let mut places = seen.places[..idx].to_vec();
                places.extend(
                    self.places_of(&text[at..], &rest)
                        .into_iter()
                        .map(|(o, i)| (o + at, i + k)),
                );
                (ids, places, Some(k))
            }
            None => {
                let full = encode(text)?;
                let places = self.places_of(text, &full);
                (full.get_ids().to_vec(), places, None)
            }
        };
        let check = reused.is_some() && self.due_for_check();
        if check {
            let full = encode(text)?;
            if full.get_ids() != ids.as_slice() {
                let mut s = self.lock();
                s.stats.checks += 1;
                s.stats.mismatches += 1;
                s.stats.disabled = true;
                s.keys.clear();
                s.order.clear();
                s.stats.texts = 0;
                s.stats.bytes = 0;
                drop(s);
                tracing::warn!(
                    text_bytes = text.len(),
                    "token reuse gave ids a full encoding does not: reuse is off for this \
                     tokenizer from now on"
                );
                return Ok(full.get_ids().to_vec());
            }
        }
        let seen = Arc::new(Seen {
            text: text.into(),
            ids: ids.clone().into_boxed_slice(),
            places,
        });
        let mut s = self.lock();
        s.stats.lookups += 1;
        s.stats.checks += u64::from(check);
        match reused {
            Some(k) => {
                s.stats.hits += 1;
                s.stats.reused_tokens += k as u64;
                s.stats.encoded_tokens += (ids.len() - k) as u64;
            }
            None => s.stats.encoded_tokens += ids.len() as u64,
        }
        self.store(&mut s, seen);
        drop(s);
        Ok(ids)
    }

    /// Whether the next reuse is checked (counted by hits so far).
    fn due_for_check(&self) -> bool {
        let hits = self.lock().stats.hits;
        hits < self.config.check_first
            || (self.config.check_every > 0 && hits.is_multiple_of(self.config.check_every))
    }

    /// The last of `starts` (places in `text`) that a text seen before confirms: that
    /// text and the index of the place in its list.
    fn find(&self, text: &str, starts: &[usize]) -> Option<(Arc<Seen>, usize)> {
        let keys: Vec<(usize, u64)> = starts
            .iter()
            .rev()
            .take(TRIES)
            .map(|&at| (at, self.key(text, at)))
            .collect();
        // One lock for every candidate; the comparisons run outside it.
        let candidates: Vec<(usize, Arc<Seen>, usize)> = {
            let s = self.lock();
            keys.iter()
                .filter_map(|(at, k)| s.keys.get(k).map(|(seen, i)| (*at, Arc::clone(seen), *i)))
                .collect()
        };
        candidates.into_iter().find_map(|(at, seen, idx)| {
            let end = at + self.margin;
            (seen.places[idx].0 == at
                && seen.text.len() >= end
                && seen.text.as_bytes()[..end] == text.as_bytes()[..end])
                .then_some((seen, idx))
        })
    }

    /// The places of `text` reuse may start at: eligible added tokens its encoding
    /// matched exactly where their content is.
    fn places_of(&self, text: &str, enc: &Encoding) -> Vec<(usize, usize)> {
        enc.get_ids()
            .iter()
            .zip(enc.get_offsets())
            .enumerate()
            .filter_map(|(i, (id, &(s, e)))| {
                let len = *self.eligible.get(id)?;
                (e == s + len && e <= text.len() && text.is_char_boundary(s)).then_some((s, i))
            })
            .collect()
    }

    /// Keeps `seen`, keyed by its last places, and drops the oldest texts past capacity.
    fn store(&self, s: &mut State, seen: Arc<Seen>) {
        let usable: Vec<usize> = (0..seen.places.len())
            .filter(|&i| seen.places[i].0 + self.margin <= seen.text.len())
            .collect();
        let mut keys = Vec::new();
        for &i in usable.iter().rev().take(KEYS_PER_TEXT) {
            let key = self.key(&seen.text, seen.places[i].0);
            s.keys.insert(key, (Arc::clone(&seen), i));
            keys.push(key);
        }
        let bytes = seen.bytes(keys.len());
        if keys.is_empty() || bytes > self.config.capacity_bytes {
            for k in keys {
                s.keys.remove(&k);
            }
            return;
        }
        s.stats.bytes += bytes as u64;
        s.stats.texts += 1;
        s.order.push_back((seen, keys));
        while s.stats.bytes > self.config.capacity_bytes as u64 {
            let Some((old, keys)) = s.order.pop_front() else {
                break;
            };
            for k in &keys {
                if s.keys.get(k).is_some_and(|(o, _)| Arc::ptr_eq(o, &old)) {
                    s.keys.remove(k);
                }
            }
            s.stats.bytes -= old.bytes(keys.len()) as u64;
            s.stats.texts -= 1;
            s.stats.evictions += 1;
        }
    }
}

#[cfg(test)]
#[path = "reuse_tests.rs"]
mod tests;
