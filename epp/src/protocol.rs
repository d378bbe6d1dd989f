//! The ext_proc messages the picker reads and writes (REFERENCE: the Gateway API Inference
//! Extension's endpoint-picker protocol, as Envoy 1.40 carries it).
//!
//! Envoy details this follows: a header mutation's value goes in `raw_value` (Envoy
//! ignores `value`) and overwrites what a client sent; the picked endpoints go both in
//! the `x-gateway-destination-endpoint` header and in the `envoy.lb` dynamic metadata
//! (what the `override_host` load-balancing policy reads, fallbacks included); a streamed
//! body is handed back as chunks of at most [`MAX_CHUNK`] bytes.

use envoy_types::pb::envoy::config::core::v3::{
    header_value_option::HeaderAppendAction, HeaderMap, HeaderValue, HeaderValueOption, Metadata,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, common_response::ResponseStatus, processing_response::Response, BodyMutation,
    BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, ImmediateResponse,
    ProcessingResponse, StreamedBodyResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};

/// The header (and `envoy.lb` metadata key) naming the picked endpoints, best first.
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
/// The `envoy.lb` metadata key naming the endpoint that served.
pub const SERVED: &str = "x-gateway-destination-endpoint-served";
/// The metadata namespace of the load balancer.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// The metadata namespace of the subset hint.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// The subset hint's key: the endpoints a request may go to.
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
/// Largest body chunk handed back in a streamed response.
pub const MAX_CHUNK: usize = 62_000;

/// A header's value: `raw_value` as Envoy sends it (or `value` from older senders).
pub fn header<'a>(h: Option<&'a HeaderMap>, name: &str) -> Option<&'a [u8]> {
    h?.headers
        .iter()
        .find(|v| v.key.eq_ignore_ascii_case(name))
        .map(|v| {
            if v.raw_value.is_empty() {
                v.value.as_bytes()
            } else {
                v.raw_value.as_slice()
            }
        })
}

/// A string (or a list of strings, joined by commas) at `namespace.key` of `metadata`.
pub fn metadata_string(m: Option<&Metadata>, namespace: &str, key: &str) -> Option<String> {
    let v = m?.filter_metadata.get(namespace)?.fields.get(key)?;
    match v.kind.as_ref()? {
        Kind::StringValue(s) => Some(s.clone()),
        Kind::ListValue(l) => Some(
            l.values
                .iter()
                .filter_map(|v| match v.kind.as_ref()? {
                    Kind::StringValue(s) => Some(s.as_str()),
                    _ => None,
                })
                .collect::<Vec<_>>()
                .join(","),
        ),
        _ => None,
    }
}

/// Endpoints in a comma-separated list, trimmed, empty entries dropped.
pub fn split_endpoints(s: &str) -> Vec<String> {
    s.split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(str::to_owned)
        .collect()
}

fn set_header(name: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: name.to_owned(),
            raw_value: value.as_bytes().to_vec(),
            ..Default::default()
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..Default::default()
    }
}

fn string_value(s: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.to_owned())),
    }
}

/// The `envoy.lb` dynamic metadata naming `endpoints`.
fn lb_metadata(endpoints: &str) -> Struct {
    let inner = Struct {
        fields: [(DESTINATION.to_owned(), string_value(endpoints))].into(),
    };
    Struct {
        fields: [(
            LB_NAMESPACE.to_owned(),
            Value {
                kind: Some(Kind::StructValue(inner)),
            },
        )]
        .into(),
    }
}

/// The answer that routes the request: the destination header (overwriting a client's)
/// and the same list in the `envoy.lb` metadata, the route cache cleared. `on_body`: the
/// answer rides on the request body (buffered mode) instead of its headers.
pub fn route_to(
    endpoints: &str,
    extra_headers: &[(&str, String)],
    on_body: bool,
) -> ProcessingResponse {
    let mut set_headers = vec![set_header(DESTINATION, endpoints)];
    set_headers.extend(extra_headers.iter().map(|(k, v)| set_header(k, v)));
    let common = CommonResponse {
        status: ResponseStatus::Continue as i32,
        header_mutation: Some(HeaderMutation {
            set_headers,
            ..Default::default()
        }),
        clear_route_cache: true,
        ..Default::default()
    };
    ProcessingResponse {
        response: Some(if on_body {
            Response::RequestBody(BodyResponse {
                response: Some(common),
            })
        } else {
            Response::RequestHeaders(HeadersResponse {
                response: Some(common),
            })
        }),
        dynamic_metadata: Some(lb_metadata(endpoints)),
        ..Default::default()
    }
}

/// Go on unchanged, at the phase `Response` names.
pub fn carry_on(phase: fn(CommonResponse) -> Response) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(phase(CommonResponse::default())),
        ..Default::default()
    }
}

pub fn request_headers(c: CommonResponse) -> Response {
    Response::RequestHeaders(HeadersResponse { response: Some(c) })
}
pub fn response_headers(c: CommonResponse) -> Response {
    Response::ResponseHeaders(HeadersResponse { response: Some(c) })
}
pub fn request_body(c: CommonResponse) -> Response {
    Response::RequestBody(BodyResponse { response: Some(c) })
}
pub fn response_body(c: CommonResponse) -> Response {
    Response::ResponseBody(BodyResponse { response: Some(c) })
}

/// A body handed back in full-duplex streamed mode: `body` in chunks of at most
/// [`MAX_CHUNK`] bytes, the last one ending the stream if `end`. An empty body that ends
/// the stream is one empty chunk.
pub fn streamed_body(
    body: &[u8],
    end: bool,
    phase: fn(CommonResponse) -> Response,
) -> Vec<ProcessingResponse> {
    let chunks: Vec<&[u8]> = if body.is_empty() {
        vec![&[][..]]
    } else {
        body.chunks(MAX_CHUNK).collect()
    };
    let n = chunks.len();
    chunks
        .into_iter()
        .enumerate()
        .map(|(i, c)| ProcessingResponse {
            response: Some(phase(CommonResponse {
                body_mutation: Some(BodyMutation {
                    mutation: Some(body_mutation::Mutation::StreamedResponse(
                        StreamedBodyResponse {
                            body: c.to_vec(),
                            end_of_stream: end && i + 1 == n,
                            ..Default::default()
                        },
                    )),
                }),
                ..Default::default()
            })),
            ..Default::default()
        })
        .collect()
}

/// An answer Envoy sends to the client instead of routing: `status` with a JSON error
/// body in the shape OpenAI clients read.
pub fn immediate(status: u16, kind: &str, message: &str) -> ProcessingResponse {
    let body = serde_json::json!({"error": {"message": message, "type": kind, "code": status}});
    ProcessingResponse {
        response: Some(Response::ImmediateResponse(ImmediateResponse {
            status: Some(HttpStatus {
                code: i32::from(status),
            }),
            headers: Some(HeaderMutation {
                set_headers: vec![set_header("content-type", "application/json")],
                ..Default::default()
            }),
            body: body.to_string().into_bytes(),
            details: format!("kvr_epp_{kind}"),
            ..Default::default()
        })),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_route_is_in_the_header_and_the_lb_metadata() {
        let r = route_to("10.0.0.1:8000,10.0.0.2:8000", &[], false);
        let Some(Response::RequestHeaders(h)) = &r.response else {
            panic!("{r:?}")
        };
        let c = h.response.as_ref().unwrap();
        assert!(c.clear_route_cache);
        let set = &c.header_mutation.as_ref().unwrap().set_headers[0];
        let hv = set.header.as_ref().unwrap();
        assert_eq!(hv.key, DESTINATION);
        assert_eq!(hv.raw_value, b"10.0.0.1:8000,10.0.0.2:8000");
        assert!(hv.value.is_empty(), "Envoy reads raw_value only");
        assert_eq!(
            set.append_action,
            HeaderAppendAction::OverwriteIfExistsOrAdd as i32
        );
        let md = Metadata {
            typed_filter_metadata: Default::default(),
            filter_metadata: r
                .dynamic_metadata
                .unwrap()
                .fields
                .into_iter()
                .map(|(k, v)| {
                    let Some(Kind::StructValue(s)) = v.kind else {
                        panic!()
                    };
                    (k, s)
                })
                .collect(),
        };
        assert_eq!(
            metadata_string(Some(&md), LB_NAMESPACE, DESTINATION).as_deref(),
            Some("10.0.0.1:8000,10.0.0.2:8000")
        );
    }

    #[test]
    fn a_long_body_goes_back_in_chunks_that_end_once() {
        let body = vec![7u8; 2 * MAX_CHUNK + 5];
        let out = streamed_body(&body, true, request_body);
        assert_eq!(out.len(), 3);
        let mut total = 0;
        for (i, r) in out.iter().enumerate() {
            let Some(Response::RequestBody(b)) = &r.response else {
                panic!()
            };
            let Some(body_mutation::Mutation::StreamedResponse(s)) = &b
                .response
                .as_ref()
                .unwrap()
                .body_mutation
                .as_ref()
                .unwrap()
                .mutation
            else {
                panic!()
            };
            assert!(s.body.len() <= MAX_CHUNK);
            assert_eq!(s.end_of_stream, i == 2);
            total += s.body.len();
        }
        assert_eq!(total, body.len());
        assert_eq!(streamed_body(&[], true, request_body).len(), 1);
    }

    #[test]
    fn subset_hints_read_as_strings_or_lists() {
        let list = Value {
            kind: Some(Kind::ListValue(
                envoy_types::pb::google::protobuf::ListValue {
                    values: vec![string_value("a:1"), string_value("b:2")],
                },
            )),
        };
        let md = Metadata {
            typed_filter_metadata: Default::default(),
            filter_metadata: [(
                SUBSET_NAMESPACE.to_owned(),
                Struct {
                    fields: [(SUBSET_KEY.to_owned(), list)].into(),
                },
            )]
            .into(),
        };
        let s = metadata_string(Some(&md), SUBSET_NAMESPACE, SUBSET_KEY).unwrap();
        assert_eq!(split_endpoints(&s), vec!["a:1", "b:2"]);
        assert_eq!(split_endpoints(" a:1 ,, b:2"), vec!["a:1", "b:2"]);
    }
}
