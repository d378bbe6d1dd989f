//! ZMQ endpoint strings (`tcp://host:port`, `tcp://[v6]:port`, `ipc://…`, `inproc://…`),
//! validated the way Dynamo's replica sync validates its peers, with the same messages.

use std::fmt;

/// A parsed endpoint. Only TCP endpoints with a concrete host can be connected to; `ipc://`
/// and `inproc://` parse (Dynamo accepts them) and are refused at connect time.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Endpoint {
    text: String,
    kind: EndpointKind,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum EndpointKind {
    /// `host` without brackets (an IPv6 literal is stored bare).
    Tcp {
        host: String,
        port: u16,
    },
    Ipc,
    Inproc,
}

impl Endpoint {
    /// The endpoint as given.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The TCP host and port, when this is a TCP endpoint.
    pub fn tcp(&self) -> Option<(&str, u16)> {
        match &self.kind {
            EndpointKind::Tcp { host, port } => Some((host, *port)),
            _ => None,
        }
    }

    /// Why this endpoint cannot be connected to over TCP, if it cannot.
    pub(crate) fn connect_refusal(&self) -> Option<EndpointError> {
        let reason = match &self.kind {
            EndpointKind::Ipc => "ipc:// is not supported (TCP only)".to_string(),
            EndpointKind::Inproc => "inproc:// is not supported (TCP only)".to_string(),
            EndpointKind::Tcp { host, .. } if host.is_empty() => "missing TCP host".to_string(),
            EndpointKind::Tcp { host, .. } if host == "*" => {
                "cannot connect to the wildcard host `*`".to_string()
            }
            EndpointKind::Tcp { .. } => return None,
        };
        Some(EndpointError {
            endpoint: self.text.clone(),
            reason,
        })
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// An endpoint that cannot be used: Display reads
/// ``invalid ZMQ endpoint `<endpoint>`: <reason>``, as Dynamo words it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointError {
    endpoint: String,
    reason: String,
}

impl EndpointError {
    /// The endpoint as given.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// What is wrong with it.
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

impl fmt::Display for EndpointError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid ZMQ endpoint `{}`: {}",
            self.endpoint, self.reason
        )
    }
}

impl std::error::Error for EndpointError {}

/// Parses `s` as Dynamo's replica sync does: a scheme, then for `tcp` a `host:port` whose
/// port is a u16 (the host may be a name, an IPv4 address, a bracketed IPv6 address or `*`).
pub fn parse_endpoint(s: &str) -> Result<Endpoint, EndpointError> {
    let fail = |reason: String| EndpointError {
        endpoint: s.to_string(),
        reason,
    };
    let Some((scheme, rest)) = s.split_once("://") else {
        return Err(fail("missing scheme".to_string()));
    };
    let kind = match scheme {
        "tcp" => {
            let Some((host, port)) = rest.rsplit_once(':') else {
                return Err(fail("missing TCP port".to_string()));
            };
            let port: u16 = port
                .parse()
                .map_err(|e| fail(format!("invalid TCP port: {e}")))?;
            let host = match host.strip_prefix('[') {
                Some(inner) => match inner.strip_suffix(']') {
                    Some(v6) => v6.to_string(),
                    None => return Err(fail("unbalanced `[` in TCP host".to_string())),
                },
                None => host.to_string(),
            };
            EndpointKind::Tcp { host, port }
        }
        "ipc" => EndpointKind::Ipc,
        "inproc" => EndpointKind::Inproc,
        "" => return Err(fail("missing scheme".to_string())),
        other => return Err(fail(format!("unsupported scheme `{other}`"))),
    };
    Ok(Endpoint {
        text: s.to_string(),
        kind,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(s: &str) -> String {
        parse_endpoint(s).unwrap_err().to_string()
    }

    #[test]
    fn dynamo_messages() {
        assert_eq!(
            err("http://x:1"),
            "invalid ZMQ endpoint `http://x:1`: unsupported scheme `http`"
        );
        assert_eq!(err(""), "invalid ZMQ endpoint ``: missing scheme");
        assert_eq!(
            err("tcp://nohost"),
            "invalid ZMQ endpoint `tcp://nohost`: missing TCP port"
        );
        assert_eq!(
            err("tcp://127.0.0.1:99999"),
            "invalid ZMQ endpoint `tcp://127.0.0.1:99999`: invalid TCP port: number too large to fit in target type"
        );
        assert_eq!(
            err("tcp://h:x"),
            "invalid ZMQ endpoint `tcp://h:x`: invalid TCP port: invalid digit found in string"
        );
    }

    #[test]
    fn accepted_forms() {
        let e = parse_endpoint("tcp://127.0.0.1:5555").unwrap();
        assert_eq!(e.tcp(), Some(("127.0.0.1", 5555)));
        assert!(e.connect_refusal().is_none());
        let e = parse_endpoint("tcp://[::1]:7").unwrap();
        assert_eq!(e.tcp(), Some(("::1", 7)));
        assert_eq!(e.as_str(), "tcp://[::1]:7");
        let e = parse_endpoint("tcp://localhost:1").unwrap();
        assert_eq!(e.tcp(), Some(("localhost", 1)));
        for s in ["ipc:///tmp/x", "inproc://x", "tcp://*:5555"] {
            let e = parse_endpoint(s).unwrap();
            let r = e.connect_refusal().expect("not connectable").to_string();
            assert!(
                r.starts_with(&format!("invalid ZMQ endpoint `{s}`: ")),
                "{r}"
            );
        }
    }
}
