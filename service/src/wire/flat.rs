//! The prompt-carrying bodies as they are read: every field inline, so serde parses the
//! body in one pass (`#[serde(flatten)]` would buffer it whole into serde's `Content`
//! and parse it again). Named as Dynamo names them, since serde's type errors say
//! "expected struct <name>". Converted into the nested [`super::select`] types, whose
//! fast form ([`WireBody::Fast`]) they are.

use serde::Deserialize;

use crate::error::{TokenSlot, WireBody};

use super::prompt::{BlockMmInfo, MmInput, PromptBody};
use super::select::{default_name, PinnedWorker, RouterConfigOverride, SessionContextBody};

/// The prompt fields, inline in each body below.
macro_rules! prompt_struct {
    ($(#[$m:meta])* $name:ident { $($(#[$fm:meta])* $field:ident : $ty:ty,)* }) => {
        $(#[$m])*
        #[derive(Debug, Deserialize)]
        pub struct $name {
            $($(#[$fm])* pub $field: $ty,)*
            #[serde(default)]
            pub token_ids: Option<Vec<u32>>,
            #[serde(default)]
            pub block_hashes: Option<Vec<i64>>,
            #[serde(default)]
            pub sequence_hashes: Option<Vec<i64>>,
            #[serde(default)]
            pub isl_tokens: Option<u64>,
            #[serde(default)]
            pub block_mm_infos: Option<Vec<Option<BlockMmInfo>>>,
            #[serde(default)]
            pub lora_name: Option<String>,
            #[serde(default)]
            pub cache_salt: Option<String>,
            #[serde(default)]
            pub mm_inputs: Option<Vec<MmInput>>,
        }

        impl $name {
            fn prompt(&mut self) -> PromptBody {
                PromptBody {
                    token_ids: self.token_ids.take(),
                    block_hashes: self.block_hashes.take(),
                    sequence_hashes: self.sequence_hashes.take(),
                    isl_tokens: self.isl_tokens,
                    block_mm_infos: self.block_mm_infos.take(),
                    lora_name: self.lora_name.take(),
                    cache_salt: self.cache_salt.take(),
                    mm_inputs: self.mm_inputs.take(),
                }
            }
        }
    };
}

prompt_struct!(SelectRequest {
    #[serde(default = "default_name")]
    model_name: String,
    #[serde(default = "default_name")]
    routing_group: String,
    #[serde(default)]
    selection_id: Option<String>,
    #[serde(default)]
    router_config_override: Option<RouterConfigOverride>,
    #[serde(default)]
    expected_output_tokens: Option<u64>,
    #[serde(default)]
    priority_jump: Option<f64>,
    #[serde(default)]
    strict_priority: Option<bool>,
    #[serde(default)]
    session_id: Option<String>,
    #[serde(default)]
    session_context: Option<SessionContextBody>,
    #[serde(default)]
    affinity_target: Option<u64>,
    #[serde(default)]
    pinned_worker: Option<PinnedWorker>,
    #[serde(default)]
    allowed_worker_ids: Option<Vec<u64>>,
    #[serde(default)]
    advisory: Option<bool>,
});

prompt_struct!(ReservationRequest {
    selection_id: String,
    #[serde(default = "default_name")]
    model_name: String,
    #[serde(default = "default_name")]
    routing_group: String,
    #[serde(default)]
    worker_id: Option<u64>,
    #[serde(default)]
    dp_rank: Option<u32>,
    #[serde(default)]
    expected_output_tokens: Option<u64>,
    #[serde(default)]
    track_prefill_tokens: Option<bool>,
});

impl From<SelectRequest> for super::select::SelectRequest {
    fn from(mut r: SelectRequest) -> Self {
        let prompt = r.prompt();
        Self {
            model_name: r.model_name,
            routing_group: r.routing_group,
            selection_id: r.selection_id,
            prompt,
            router_config_override: r.router_config_override,
            expected_output_tokens: r.expected_output_tokens,
            priority_jump: r.priority_jump,
            strict_priority: r.strict_priority,
            session_id: r.session_id,
            session_context: r.session_context,
            affinity_target: r.affinity_target,
            pinned_worker: r.pinned_worker,
            allowed_worker_ids: r.allowed_worker_ids,
            advisory: r.advisory,
        }
    }
}

impl From<ReservationRequest> for super::select::ReservationRequest {
    fn from(mut r: ReservationRequest) -> Self {
        let prompt = r.prompt();
        Self {
            selection_id: r.selection_id,
            model_name: r.model_name,
            routing_group: r.routing_group,
            worker_id: r.worker_id,
            dp_rank: r.dp_rank,
            prompt,
            expected_output_tokens: r.expected_output_tokens,
            track_prefill_tokens: r.track_prefill_tokens,
        }
    }
}

/// The nested bodies are read through these (their `token_ids` by hand, when the split
/// accepts).
impl WireBody for super::select::SelectRequest {
    type Fast = SelectRequest;
    const TOKEN_SLOT: Option<TokenSlot<Self::Fast>> = Some(|f| &mut f.token_ids);
}

impl WireBody for super::select::ReservationRequest {
    type Fast = ReservationRequest;
    const TOKEN_SLOT: Option<TokenSlot<Self::Fast>> = Some(|f| &mut f.token_ids);
}

#[cfg(test)]
mod tests {
    use crate::wire::select::SelectRequest;

    #[test]
    fn bodies_read_inline_and_name_dynamos_type() {
        let b: SelectRequest = serde_json::from_str::<super::SelectRequest>(
            r#"{"model_name":"m","token_ids":[1,2,3],"lora_name":"a","unknown":{"x":1}}"#,
        )
        .unwrap()
        .into();
        assert_eq!(b.model_name, "m");
        assert_eq!(b.routing_group, "default");
        assert_eq!(b.prompt.token_ids.as_deref(), Some(&[1, 2, 3][..]));
        assert_eq!(b.prompt.lora_name.as_deref(), Some("a"));
        let e = serde_json::from_str::<super::SelectRequest>(r#"{"token_ids":["x"]}"#).unwrap_err();
        assert!(e.to_string().contains("expected u32"), "{e}");
        // The flattened form's errors are Dynamo's (no path, as flatten loses it).
        let e = serde_json::from_str::<SelectRequest>("[1,2]").unwrap_err();
        assert!(
            e.to_string().contains("expected struct SelectRequest"),
            "{e}"
        );
    }
}
