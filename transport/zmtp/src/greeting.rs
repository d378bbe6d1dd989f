//! The ZMTP 3 greeting: 64 bytes each side sends first (signature, version, mechanism,
//! as-server, filler). We greet as 3.1 with the NULL mechanism and as-server 0.

use std::fmt;

/// Greeting length in bytes.
pub(crate) const GREETING_LEN: usize = 64;
/// Bytes needed to see the peer's major version (signature + major).
const MAJOR_AT: usize = 10;
const MECHANISM: std::ops::Range<usize> = 12..32;

/// Our greeting: ZMTP 3.1, mechanism NULL, as-server 0, zero filler; the padding is
/// libzmq's (a 1 in its last byte), so our greeting is byte for byte a libzmq one.
pub(crate) fn encode_greeting() -> [u8; GREETING_LEN] {
    let mut g = [0u8; GREETING_LEN];
    g[0] = 0xFF;
    g[8] = 1;
    g[9] = 0x7F;
    g[10] = 3;
    g[11] = 1;
    g[MECHANISM.start..MECHANISM.start + 4].copy_from_slice(b"NULL");
    g
}

/// What the peer's greeting says about the protocol spoken after it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PeerVersion {
    /// ZMTP 3.0: subscriptions travel as `0x01`/`0x00`-prefixed messages.
    V30,
    /// ZMTP 3.1 or newer (a newer peer speaks our version): SUBSCRIBE/CANCEL commands.
    V31,
}

/// Why a peer's greeting was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum GreetingError {
    BadSignature,
    VersionTooOld { major: u8, minor: u8 },
    Mechanism(String),
}

impl fmt::Display for GreetingError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GreetingError::BadSignature => f.write_str("not a ZMTP 3 peer (bad greeting signature)"),
            GreetingError::VersionTooOld { major, minor } => write!(
                f,
                "peer greeted with ZMTP revision {major}.{minor}; only ZMTP 3.0 and 3.1 are supported"
            ),
            GreetingError::Mechanism(m) => {
                write!(f, "peer asks for security mechanism `{m}`; only NULL is supported")
            }
        }
    }
}

/// Checks as much of the peer's greeting as has arrived: `Ok(None)` means "need more bytes"
/// (a bad signature or an old version is refused as soon as its byte is in, so that a
/// ZMTP 2 peer, which sends a shorter greeting and waits, is not left hanging).
pub(crate) fn check_greeting(got: &[u8]) -> Result<Option<PeerVersion>, GreetingError> {
    if let Some(&b0) = got.first() {
        if b0 != 0xFF {
            return Err(GreetingError::BadSignature);
        }
    }
    if got.len() > 9 && got[9] != 0x7F {
        return Err(GreetingError::BadSignature);
    }
    if got.len() > MAJOR_AT {
        let major = got[MAJOR_AT];
        let minor = got.get(MAJOR_AT + 1).copied().unwrap_or(0);
        if major < 3 {
            return Err(GreetingError::VersionTooOld { major, minor });
        }
    }
    if got.len() < GREETING_LEN {
        return Ok(None);
    }
    let mech = &got[MECHANISM];
    let name_len = mech.iter().position(|&b| b == 0).unwrap_or(mech.len());
    if &mech[..name_len] != b"NULL" || mech[name_len..].iter().any(|&b| b != 0) {
        let shown = String::from_utf8_lossy(&mech[..name_len]).into_owned();
        return Err(GreetingError::Mechanism(shown));
    }
    let (major, minor) = (got[MAJOR_AT], got[MAJOR_AT + 1]);
    Ok(Some(if major == 3 && minor == 0 {
        PeerVersion::V30
    } else {
        PeerVersion::V31
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn our_greeting_is_dynamos_bytes() {
        // The greeting Dynamo's libzmq PUB sent (research capture), 64 bytes.
        let mut want = vec![0xFF, 0, 0, 0, 0, 0, 0, 0, 1, 0x7F, 3, 1];
        want.extend_from_slice(b"NULL");
        want.resize(64, 0);
        let g = encode_greeting();
        assert_eq!(&g[..], &want[..]);
        assert_eq!(check_greeting(&g), Ok(Some(PeerVersion::V31)));
        assert_eq!(check_greeting(&want), Ok(Some(PeerVersion::V31)));
    }

    #[test]
    fn versions() {
        let mut g = encode_greeting();
        g[11] = 0;
        assert_eq!(check_greeting(&g), Ok(Some(PeerVersion::V30)));
        g[10] = 4;
        assert_eq!(check_greeting(&g), Ok(Some(PeerVersion::V31)));
        // ZMTP 2.0 sends signature + revision 1 + socket type, then waits: refused at 11 bytes.
        let mut v2 = encode_greeting()[..12].to_vec();
        v2[10] = 1;
        v2[11] = 1;
        assert_eq!(
            check_greeting(&v2[..11]),
            Err(GreetingError::VersionTooOld { major: 1, minor: 0 })
        );
        let mut v2 = encode_greeting();
        v2[10] = 2;
        assert!(check_greeting(&v2).is_err());
    }

    #[test]
    fn malformed_greetings_are_refused_or_wait() {
        let g = encode_greeting();
        for n in 0..GREETING_LEN {
            assert_eq!(check_greeting(&g[..n]), Ok(None), "truncated at {n}");
        }
        assert_eq!(
            check_greeting(b"GET / HTTP/1.1"),
            Err(GreetingError::BadSignature)
        );
        let mut bad = g;
        bad[9] = 0x7E;
        assert_eq!(check_greeting(&bad[..10]), Err(GreetingError::BadSignature));
        let mut curve = g;
        curve[12..17].copy_from_slice(b"CURVE");
        assert_eq!(
            check_greeting(&curve),
            Err(GreetingError::Mechanism("CURVE".into()))
        );
        let mut trailing = g;
        trailing[20] = b'X';
        assert!(matches!(
            check_greeting(&trailing),
            Err(GreetingError::Mechanism(_))
        ));
        // Arbitrary bytes never panic.
        let mut x: u32 = 1;
        for _ in 0..2000 {
            let mut buf = [0u8; GREETING_LEN];
            for b in buf.iter_mut() {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                *b = x as u8;
            }
            buf[0] = 0xFF;
            let _ = check_greeting(&buf);
        }
    }
}
