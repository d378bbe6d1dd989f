//! ZMTP 3 frames (flags, short or long size, body) and the commands carried in command
//! frames (READY, PING, PONG, SUBSCRIBE, CANCEL, ERROR). Decoding never trusts a length
//! before checking it against the configured bound.

use std::fmt;

use bytes::{Buf, BufMut, Bytes, BytesMut};

const FLAG_MORE: u8 = 0x01;
const FLAG_LONG: u8 = 0x02;
const FLAG_COMMAND: u8 = 0x04;
const FLAGS_RESERVED: u8 = !(FLAG_MORE | FLAG_LONG | FLAG_COMMAND);

/// One frame: a message part (with MORE when others follow) or a command.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Frame {
    pub(crate) more: bool,
    pub(crate) command: bool,
    pub(crate) body: Bytes,
}

/// A frame that cannot be decoded; the connection is closed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum FrameError {
    ReservedFlags(u8),
    TooLarge { len: u64, max: usize },
    CommandWithMore,
}

impl fmt::Display for FrameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FrameError::ReservedFlags(b) => write!(f, "frame flags {b:#04x} set reserved bits"),
            FrameError::TooLarge { len, max } => {
                write!(f, "frame of {len} bytes exceeds the {max}-byte bound")
            }
            FrameError::CommandWithMore => f.write_str("command frame with the MORE flag"),
        }
    }
}

/// Takes one whole frame off the front of `buf`, or `Ok(None)` when it has not all arrived.
/// A size above `max` is refused from its header alone, before any of it is buffered.
pub(crate) fn decode_frame(buf: &mut BytesMut, max: usize) -> Result<Option<Frame>, FrameError> {
    let Some(&flags) = buf.first() else {
        return Ok(None);
    };
    if flags & FLAGS_RESERVED != 0 {
        return Err(FrameError::ReservedFlags(flags));
    }
    let command = flags & FLAG_COMMAND != 0;
    let more = flags & FLAG_MORE != 0;
    if command && more {
        return Err(FrameError::CommandWithMore);
    }
    let (header, len) = if flags & FLAG_LONG != 0 {
        if buf.len() < 9 {
            return Ok(None);
        }
        let mut size = [0u8; 8];
        size.copy_from_slice(&buf[1..9]);
        (9, u64::from_be_bytes(size))
    } else {
        if buf.len() < 2 {
            return Ok(None);
        }
        (2, u64::from(buf[1]))
    };
    if len > max as u64 {
        return Err(FrameError::TooLarge { len, max });
    }
    let len = len as usize; // <= max, a usize
    if buf.len() - header < len {
        return Ok(None);
    }
    buf.advance(header);
    let body = buf.split_to(len).freeze();
    Ok(Some(Frame {
        more,
        command,
        body,
    }))
}

/// Appends a frame: the short form up to 255 bytes, the long form above.
pub(crate) fn encode_frame(out: &mut BytesMut, more: bool, command: bool, body: &[u8]) {
    let mut flags = 0;
    if more {
        flags |= FLAG_MORE;
    }
    if command {
        flags |= FLAG_COMMAND;
    }
    if body.len() <= 255 {
        out.reserve(2 + body.len());
        out.put_u8(flags);
        out.put_u8(body.len() as u8);
    } else {
        out.reserve(9 + body.len());
        out.put_u8(flags | FLAG_LONG);
        out.put_u64(body.len() as u64);
    }
    out.put_slice(body);
}

/// Appends a command frame `name` + `data` (name at most 255 bytes: ours are constants).
pub(crate) fn encode_command(out: &mut BytesMut, name: &[u8], data: &[u8]) {
    let mut body = Vec::with_capacity(1 + name.len() + data.len());
    body.push(name.len() as u8);
    body.extend_from_slice(name);
    body.extend_from_slice(data);
    encode_frame(out, false, true, &body);
}

/// Appends a READY command carrying only `Socket-Type`, as libzmq's PUB and SUB do.
pub(crate) fn encode_ready(out: &mut BytesMut, socket_type: &str) {
    let mut data = Vec::new();
    data.push(b"Socket-Type".len() as u8);
    data.extend_from_slice(b"Socket-Type");
    data.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
    data.extend_from_slice(socket_type.as_bytes());
    encode_command(out, b"READY", &data);
}

/// Appends a PING with `ttl_deciseconds` and an empty context.
pub(crate) fn encode_ping(out: &mut BytesMut, ttl_deciseconds: u16) {
    encode_command(out, b"PING", &ttl_deciseconds.to_be_bytes());
}

/// A decoded command.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Command {
    /// READY's `Socket-Type` property (other properties are ignored).
    Ready {
        socket_type: Option<Bytes>,
    },
    Ping {
        ttl_deciseconds: u16,
        context: Bytes,
    },
    Pong {
        context: Bytes,
    },
    Subscribe(Bytes),
    Cancel(Bytes),
    Error(String),
    /// A well-formed command we do not use (ignored and counted by the connection).
    Other(Bytes),
}

/// A command frame that breaks the command grammar; the connection is closed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum CommandError {
    Empty,
    NameOverflow { name_len: usize, body_len: usize },
    BadReady,
    BadPing,
}

impl fmt::Display for CommandError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CommandError::Empty => f.write_str("empty command frame"),
            CommandError::NameOverflow { name_len, body_len } => write!(
                f,
                "command name length {name_len} overflows its {body_len}-byte frame"
            ),
            CommandError::BadReady => f.write_str("malformed READY properties"),
            CommandError::BadPing => {
                f.write_str("malformed PING (TTL missing or context over 16 bytes)")
            }
        }
    }
}

/// Parses a command frame's body.
pub(crate) fn parse_command(mut body: Bytes) -> Result<Command, CommandError> {
    let Some(&name_len) = body.first() else {
        return Err(CommandError::Empty);
    };
    let name_len = usize::from(name_len);
    if name_len == 0 || 1 + name_len > body.len() {
        return Err(CommandError::NameOverflow {
            name_len,
            body_len: body.len(),
        });
    }
    body.advance(1);
    let name = body.split_to(name_len);
    let data = body;
    Ok(match &name[..] {
        b"READY" => Command::Ready {
            socket_type: parse_ready(data)?,
        },
        b"PING" => {
            if data.len() < 2 || data.len() > 2 + 16 {
                return Err(CommandError::BadPing);
            }
            Command::Ping {
                ttl_deciseconds: u16::from_be_bytes([data[0], data[1]]),
                context: data.slice(2..),
            }
        }
        b"PONG" => Command::Pong { context: data },
        b"SUBSCRIBE" => Command::Subscribe(data),
        b"CANCEL" => Command::Cancel(data),
        b"ERROR" => {
            // reason: a length byte then text; show what is there even if the length lies.
            let text = data.get(1..).unwrap_or(&[]);
            let n = data.first().map_or(0, |&n| usize::from(n)).min(text.len());
            Command::Error(String::from_utf8_lossy(&text[..n]).into_owned())
        }
        _ => Command::Other(name),
    })
}

/// READY's metadata: repeated (name-len u8, name, value-len u32 BE, value).
fn parse_ready(mut data: Bytes) -> Result<Option<Bytes>, CommandError> {
    let mut socket_type = None;
    while !data.is_empty() {
        let name_len = usize::from(data[0]);
        if name_len == 0 || data.len() < 1 + name_len + 4 {
            return Err(CommandError::BadReady);
        }
        data.advance(1);
        let name = data.split_to(name_len);
        let value_len = data.get_u32() as usize;
        if value_len > data.len() {
            return Err(CommandError::BadReady);
        }
        let value = data.split_to(value_len);
        if name.eq_ignore_ascii_case(b"Socket-Type") {
            socket_type = Some(value);
        }
    }
    Ok(socket_type)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(bytes: &[u8], max: usize) -> Result<Option<Frame>, FrameError> {
        decode_frame(&mut BytesMut::from(bytes), max)
    }

    #[test]
    fn round_trips_short_and_long() {
        for (len, more, command) in [
            (0, false, false),
            (1, true, false),
            (255, true, false),
            (256, false, false),
            (70_000, true, false),
            (10, false, true),
            (300, false, true),
        ] {
            let body: Vec<u8> = (0..len).map(|i| i as u8).collect();
            let mut out = BytesMut::new();
            encode_frame(&mut out, more, command, &body);
            assert_eq!(out.len(), body.len() + if len <= 255 { 2 } else { 9 });
            let mut buf = out.clone();
            buf.extend_from_slice(b"\x00"); // the next frame's first byte stays
            let f = decode_frame(&mut buf, 1 << 20).unwrap().unwrap();
            assert_eq!((f.more, f.command, &f.body[..]), (more, command, &body[..]));
            assert_eq!(&buf[..], b"\x00");
            // Every strict prefix is "need more", never an error or a frame.
            for n in 0..out.len() {
                assert_eq!(one(&out[..n], 1 << 20), Ok(None), "len {len} prefix {n}");
            }
        }
    }

    #[test]
    fn malformed_frames_are_refused() {
        assert_eq!(one(&[0x08, 0], 100), Err(FrameError::ReservedFlags(0x08)));
        assert_eq!(one(&[0x80, 0], 100), Err(FrameError::ReservedFlags(0x80)));
        assert_eq!(one(&[0x05, 0], 100), Err(FrameError::CommandWithMore));
        // An absurd long size is refused from the 9-byte header, nothing allocated.
        let mut absurd = vec![0x02];
        absurd.extend_from_slice(&u64::MAX.to_be_bytes());
        assert_eq!(
            one(&absurd, 16 << 20),
            Err(FrameError::TooLarge {
                len: u64::MAX,
                max: 16 << 20
            })
        );
        assert_eq!(
            one(&[0x00, 200], 100),
            Err(FrameError::TooLarge { len: 200, max: 100 })
        );
        assert_eq!(one(&[0x00, 100], 100), Ok(None));
    }

    #[test]
    fn commands() {
        let cmd = |name: &[u8], data: &[u8]| {
            let mut out = BytesMut::new();
            encode_command(&mut out, name, data);
            let f = decode_frame(&mut out, 1000).unwrap().unwrap();
            assert!(f.command && !f.more);
            parse_command(f.body)
        };
        assert_eq!(
            cmd(b"PING", &[0x00, 0x96]),
            Ok(Command::Ping {
                ttl_deciseconds: 150,
                context: Bytes::new()
            })
        );
        assert_eq!(
            cmd(b"PING", b"\x00\x01ctx"),
            Ok(Command::Ping {
                ttl_deciseconds: 1,
                context: Bytes::from_static(b"ctx")
            })
        );
        assert_eq!(cmd(b"PING", &[0]), Err(CommandError::BadPing));
        assert_eq!(cmd(b"PING", &[0; 19]), Err(CommandError::BadPing));
        assert_eq!(
            cmd(b"PONG", b"ctx"),
            Ok(Command::Pong {
                context: Bytes::from_static(b"ctx")
            })
        );
        assert_eq!(
            cmd(b"SUBSCRIBE", b"dynamo."),
            Ok(Command::Subscribe(Bytes::from_static(b"dynamo.")))
        );
        assert_eq!(cmd(b"CANCEL", b""), Ok(Command::Cancel(Bytes::new())));
        assert_eq!(cmd(b"ERROR", b"\x03bad"), Ok(Command::Error("bad".into())));
        assert_eq!(cmd(b"ERROR", b"\x09bad"), Ok(Command::Error("bad".into())));
        assert_eq!(
            cmd(b"JOIN", b"grp"),
            Ok(Command::Other(Bytes::from_static(b"JOIN")))
        );
        // Name length past the end of the frame, or zero, or an empty frame.
        assert_eq!(
            parse_command(Bytes::from_static(b"\x09PING")),
            Err(CommandError::NameOverflow {
                name_len: 9,
                body_len: 5
            })
        );
        assert!(parse_command(Bytes::from_static(b"\x00")).is_err());
        assert_eq!(parse_command(Bytes::new()), Err(CommandError::Empty));
    }

    #[test]
    fn ready_properties() {
        let mut out = BytesMut::new();
        encode_ready(&mut out, "PUB");
        let f = decode_frame(&mut out, 1000).unwrap().unwrap();
        // Exactly libzmq's READY from a PUB: 04 1a 05 READY 0b Socket-Type 00000003 PUB.
        let mut want = vec![5u8];
        want.extend_from_slice(b"READY\x0bSocket-Type\x00\x00\x00\x03PUB");
        assert_eq!(&f.body[..], &want[..]);
        assert_eq!(
            parse_command(f.body),
            Ok(Command::Ready {
                socket_type: Some(Bytes::from_static(b"PUB"))
            })
        );
        // Identity and unknown properties are ignored; order does not matter.
        let body = Bytes::from_static(
            b"\x05READY\x08Identity\x00\x00\x00\x02id\x0bSocket-Type\x00\x00\x00\x03SUB\x01X\x00\x00\x00\x00",
        );
        assert_eq!(
            parse_command(body),
            Ok(Command::Ready {
                socket_type: Some(Bytes::from_static(b"SUB"))
            })
        );
        for bad in [
            &b"\x05READY\x0bSocket-Type\x00\x00\x00\x09PUB"[..],
            &b"\x05READY\x0bSocket-Type\x00\x00"[..],
            &b"\x05READY\x20Socket-Type"[..],
            &b"\x05READY\x00"[..],
        ] {
            assert_eq!(
                parse_command(Bytes::copy_from_slice(bad)),
                Err(CommandError::BadReady),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn garbage_never_panics() {
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        for _ in 0..5000 {
            let mut bytes = Vec::new();
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            for i in 0..(x % 40) {
                bytes.push((x >> (i % 8 * 8)) as u8 ^ i as u8);
            }
            let mut buf = BytesMut::from(&bytes[..]);
            while let Ok(Some(f)) = decode_frame(&mut buf, 64) {
                if f.command {
                    let _ = parse_command(f.body);
                }
            }
            let _ = parse_command(Bytes::from(bytes));
        }
    }
}
