//! Hybrid (attention + Mamba) publishers for the generator: which KV-cache groups a
//! worker's events name, and its recurrent group's events — stores naming a few of the
//! attention blocks (the state checkpoints of vLLM's align mode: token ids of every block
//! the names span, a null block's name left out; or tokenless, as a CPU checkpoint), and
//! removals of the names of states the rank holds.

use arbitrary::{Result, Unstructured};
use kvr::ingress::{Medium, SpecKind};
use kvr::{RankId, WorkerId};

use super::{pick, tier, Ev, Extras, Harness, TokenlessWire, Unread};

/// The KV-cache groups a worker's engine has.
#[derive(Clone, Copy, Debug)]
pub(super) enum Layout {
    /// One attention group (or none named), with now and then a sliding-window group.
    Plain,
    /// A full-attention group and a recurrent group `mamba` (0: the Mamba group comes
    /// first, as in Qwen3-Next and Nemotron-H; 1: after), the other being attention.
    Hybrid { mamba: u32 },
}

impl Layout {
    pub(super) fn gen(u: &mut Unstructured<'_>) -> Result<Layout> {
        Ok([
            Layout::Plain,
            Layout::Hybrid { mamba: 1 },
            Layout::Hybrid { mamba: 0 },
        ][pick(u, &[2, 1, 1])?])
    }

    pub(super) fn is_hybrid(self) -> bool {
        matches!(self, Layout::Hybrid { .. })
    }

    /// An attention store's group and kind.
    pub(super) fn attention(self, u: &mut Unstructured<'_>) -> Result<(Option<u32>, SpecKind)> {
        Ok(match self {
            Layout::Plain => (
                [None, Some(0), Some(1)][pick(u, &[4, 4, 1])?],
                [
                    SpecKind::Unspecified,
                    SpecKind::FullAttention,
                    SpecKind::Other,
                ][pick(u, &[4, 4, 1])?],
            ),
            Layout::Hybrid { mamba } => match pick(u, &[8, 1, 1])? {
                0 => (Some(1 - mamba), SpecKind::FullAttention),
                1 => (Some(1 - mamba), SpecKind::Unspecified),
                _ => (None, SpecKind::Unspecified),
            },
        })
    }

    /// An attention removal's group.
    pub(super) fn attention_removal(self, u: &mut Unstructured<'_>) -> Result<Option<u32>> {
        Ok(match self {
            Layout::Plain => [None, Some(0), Some(1)][pick(u, &[4, 4, 1])?],
            Layout::Hybrid { mamba } => [Some(1 - mamba), None][pick(u, &[6, 1])?],
        })
    }

    /// The recurrent group's index as an event names it (on a plain worker: none, or a
    /// third group).
    fn recurrent(self, u: &mut Unstructured<'_>) -> Result<Option<u32>> {
        Ok(match self {
            Layout::Plain => [None, Some(2)][pick(u, &[1, 1])?],
            Layout::Hybrid { mamba } => [Some(mamba), None][pick(u, &[8, 1])?],
        })
    }
}

impl Harness {
    /// A recurrent group's store on `rank`: states at some of the blocks of `beside` (an
    /// attention store of the same batch), else of blocks the rank holds.
    pub(super) fn gen_mamba_store(
        &mut self,
        u: &mut Unstructured<'_>,
        w: WorkerId,
        rank: RankId,
        layout: Layout,
        beside: Option<&Ev>,
    ) -> Result<Ev> {
        let group = layout.recurrent(u)?;
        let medium =
            [Medium::Gpu, Medium::Cpu, Medium::Storage, Medium::Unknown][pick(u, &[10, 4, 1, 1])?];
        let (span, parent) = match beside {
            Some(Ev::Stored { hashes, parent, .. }) if !hashes.is_empty() => {
                (hashes.clone(), *parent)
            }
            _ => {
                let mut names: Vec<u64> = self
                    .model
                    .rank(rank)
                    .map(|rm| rm.names.iter().flat_map(|m| m.keys().copied()).collect())
                    .unwrap_or_default();
                names.sort_unstable();
                names.dedup();
                let n = names.len().min([1, 2, 4][pick(u, &[2, 2, 1])?]);
                let from = if names.is_empty() {
                    0
                } else {
                    u.choose_index(names.len() - n + 1)?
                };
                (names[from..from + n].to_vec(), None)
            }
        };
        if u.ratio(1, 16)? {
            // A store of no state: no names, no tokens (a store of nothing, of a recurrent
            // group).
            return Ok(Ev::Stored {
                medium,
                parent: None,
                hashes: Vec::new(),
                tokens: Vec::new(),
                block_size: self.bs,
                lora: None,
                extras: Extras::default(),
                lookahead: Vec::new(),
                group,
                spec: SpecKind::Recurrent,
            });
        }
        let mut hashes: Vec<u64> = match pick(u, &[6, 2, 1, 1, 1])? {
            // One state at the end of what the request computed (align mode).
            0 => span.last().copied().into_iter().collect(),
            // Every other block's, the last one's included.
            1 => span.iter().rev().step_by(2).rev().copied().collect(),
            2 => span.clone(),
            3 if !span.is_empty() => vec![span[u.choose_index(span.len())?]],
            // And a name the rank may hold on no tier (left out, counted).
            _ => {
                let mut v: Vec<u64> = span.last().copied().into_iter().collect();
                v.push(match self.known_pick(u, w)? {
                    Some(h) if u.ratio(1, 2)? => h,
                    _ => u.arbitrary::<u64>()?,
                });
                v
            }
        };
        if hashes.is_empty() {
            hashes.push(self.known_pick(u, w)?.unwrap_or(0x5eed));
        }
        // A checkpoint offloaded to the CPU comes without token ids.
        let tokenless = (medium != Medium::Gpu && u.ratio(2, 3)?) || u.ratio(1, 10)?;
        let (tokens, block_size) = if tokenless {
            (Vec::new(), [0, self.bs][pick(u, &[2, 1])?])
        } else {
            let n = span.len().max(1) * self.bs as usize;
            let mut t = Vec::with_capacity(n);
            for _ in 0..n {
                t.push(u.int_in_range(0..=3u32)?);
            }
            // The group's block size, or one the attention group does not have.
            (t, [self.bs, self.bs * 4][pick(u, &[4, 1])?])
        };
        Ok(Ev::Tokenless {
            medium,
            hashes,
            group,
            spec: SpecKind::Recurrent,
            wire: Unread(TokenlessWire {
                parent,
                tokens,
                block_size,
            }),
        })
    }

    /// A recurrent group's removal: names of states the rank holds (on the event's tier
    /// mostly), of blocks, or unknown.
    pub(super) fn gen_mamba_remove(
        &mut self,
        u: &mut Unstructured<'_>,
        w: WorkerId,
        rank: RankId,
        layout: Layout,
    ) -> Result<Ev> {
        let group = layout.recurrent(u)?;
        // Mostly the tier of a state the rank has.
        let has = |t: usize| {
            self.model
                .rank(rank)
                .is_some_and(|rm| !rm.states[t].is_empty())
        };
        let with_states: Vec<Medium> = [Medium::Gpu, Medium::Cpu, Medium::Storage]
            .into_iter()
            .enumerate()
            .filter(|&(t, _)| has(t))
            .map(|(_, m)| m)
            .collect();
        let medium = if !with_states.is_empty() && u.ratio(4, 5)? {
            with_states[u.choose_index(with_states.len())?]
        } else {
            [Medium::Gpu, Medium::Cpu, Medium::Storage, Medium::Unknown][pick(u, &[8, 4, 1, 1])?]
        };
        let mut names: Vec<u64> = Vec::new();
        if let Some(rm) = self.model.rank(rank) {
            if let Some(t) = tier(medium) {
                names.extend(rm.states[t as usize].keys().copied());
            }
            if names.is_empty() || u.ratio(1, 6)? {
                names.extend(rm.states.iter().flat_map(|m| m.keys().copied()));
                names.extend(rm.names.iter().flat_map(|m| m.keys().copied()));
            }
        }
        names.sort_unstable();
        names.dedup();
        let n = [1usize, 2, 3][pick(u, &[4, 2, 1])?];
        let mut hashes = Vec::with_capacity(n);
        for _ in 0..n {
            hashes.push(match pick(u, &[6, 1])? {
                0 if !names.is_empty() => names[u.choose_index(names.len())?],
                _ => match self.known_pick(u, w)? {
                    Some(h) => h,
                    None => u.arbitrary::<u64>()?,
                },
            });
        }
        Ok(Ev::Removed {
            medium,
            hashes,
            group,
        })
    }
}
