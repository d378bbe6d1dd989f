//! What a selection is asked: the prompt and the caller's constraints.

use std::time::Duration;

use crate::cost::CostOverrides;
use crate::hash::BlockExtras;
use crate::ids::SelectionId;
use crate::ids::{DpRank, WorkerId};
use crate::session::SessionContext;

/// A prompt, as tokens (kvr hashes them) or as precomputed local block hashes.
#[derive(Clone, Copy, Debug)]
pub enum Prompt<'a> {
    /// The prompt's tokens (kvr cuts them into blocks and hashes them).
    Tokens(&'a [u32]),
    /// Local hashes of the prompt's complete blocks, and the prompt's length in tokens.
    LocalHashes {
        /// Local hashes of the complete blocks, first block first.
        hashes: &'a [u64],
        /// The prompt's length, tokens.
        prompt_tokens: u64,
    },
}

/// One selection request.
#[derive(Clone, Debug)]
pub struct SelectRequest<'a> {
    /// The prompt.
    pub prompt: Prompt<'a>,
    /// A tokens prompt's extra keys (multimodal inputs, cache salt: `hash::extra`), so it
    /// matches the blocks engines published with the same keys; for a hashes prompt, the
    /// keys of its `source_tokens` (its hashes already include them). `None` = none.
    pub extras: Option<&'a BlockExtras>,
    /// A hashes prompt's tokens, when the caller hashed them itself (with `extras` and
    /// `lora_name`): ranks whose engines hash with lookahead (`hash::lookahead`) are
    /// matched through them; without them such ranks match none of a hashes prompt.
    /// Ignored for a tokens prompt.
    pub source_tokens: Option<&'a [u32]>,
    /// LoRA adapter: salts the hashes and narrows the candidates to workers serving it.
    pub lora_name: Option<&'a str>,
    /// The caller's allow-set of workers (`None` = every worker of the partition).
    pub allowed_workers: Option<&'a [WorkerId]>,
    /// Route to this worker (if allowed); LoRA narrowing never removes an allowed pin.
    pub pinned_worker: Option<WorkerId>,
    /// With `pinned_worker`: only this DP rank of it (Dynamo's `pinned_worker.dp_rank`); a
    /// rank the worker does not have leaves the pin at the worker.
    pub pinned_dp_rank: Option<DpRank>,
    /// The request's session: steers by affinity and is carried to the decision.
    pub session: Option<SessionContext>,
    /// Legacy flat session id, used only when `session` is absent.
    pub legacy_session_id: Option<&'a str>,
    /// This request's cost knobs (`CostOverrides::NONE` = the configured ones).
    pub overrides: CostOverrides,
    /// Expected output tokens (booked into the decode load as output blocks grow).
    pub expected_output_tokens: u64,
    /// Booked mode: the caller's own selection id (a duplicate is an error); `None` = minted.
    pub selection_id: Option<SelectionId>,
    /// Booked mode: booking lifetime (`None` = the partition's default).
    pub ttl: Option<Duration>,
}

impl<'a> SelectRequest<'a> {
    /// A request for a prompt of tokens, with nothing else set.
    pub fn tokens(tokens: &'a [u32]) -> Self {
        Self::with_prompt(Prompt::Tokens(tokens))
    }

    /// A request for a prompt given as local block hashes and its length in tokens, with
    /// nothing else set.
    pub fn local_hashes(hashes: &'a [u64], prompt_tokens: u64) -> Self {
        Self::with_prompt(Prompt::LocalHashes {
            hashes,
            prompt_tokens,
        })
    }

    fn with_prompt(prompt: Prompt<'a>) -> Self {
        SelectRequest {
            prompt,
            extras: None,
            source_tokens: None,
            lora_name: None,
            allowed_workers: None,
            pinned_worker: None,
            pinned_dp_rank: None,
            session: None,
            legacy_session_id: None,
            overrides: CostOverrides::NONE,
            expected_output_tokens: 0,
            selection_id: None,
            ttl: None,
        }
    }

    /// The session context the decision carries: the structured one, else one built from
    /// the legacy flat id.
    pub fn effective_session(&self) -> Option<SessionContext> {
        self.session.clone().or_else(|| {
            self.legacy_session_id.map(|id| SessionContext {
                session_id: id.to_string(),
                ..SessionContext::default()
            })
        })
    }
}
