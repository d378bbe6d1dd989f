//! Chat rendering: OpenAI-shaped messages through a model's Jinja chat template, as
//! transformers' `apply_chat_template` (which vLLM calls) renders them.
//!
//! The environment mirrors transformers': `trim_blocks` and `lstrip_blocks` on, loop
//! controls, Python string and dict methods, `raise_exception(msg)` (fails the render)
//! and `strftime_now(fmt)` (the current UTC time). The context has `messages`,
//! `add_generation_prompt` (true), `bos_token` and `eos_token` (empty strings when the
//! model names none); `tools` and `documents` are undefined. A message's content is a
//! string: a list of text parts is joined with `"\n"` (vLLM's "string" content format).
//!
//! Without a template, [`render_plain`] writes one `role: content\n` line per message
//! followed by `assistant: ` (no special tokens).

use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::{Environment, Error as JinjaError, ErrorKind, Value};
use serde::Serialize;

/// One chat message as the template sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`... (not checked: templates decide).
    pub role: String,
    /// The text (text parts already joined); `None` for a message whose `content` was
    /// null (an assistant turn that only calls tools). Templates see `none`.
    pub content: Option<String>,
}

impl ChatMessage {
    /// A message with text content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: Some(content.into()),
        }
    }
}

/// Why a chat could not be rendered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChatError {
    /// The template does not parse.
    BadTemplate(String),
    /// The template failed on these messages (`raise_exception` included).
    Render(String),
}

impl std::fmt::Display for ChatError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ChatError::BadTemplate(e) => write!(f, "chat template does not parse: {e}"),
            ChatError::Render(e) => write!(f, "chat template failed: {e}"),
        }
    }
}

impl std::error::Error for ChatError {}

const TEMPLATE_NAME: &str = "chat";

/// A compiled chat template with the special tokens it prints. `Send + Sync`.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source` (checked now, so a broken template fails at load, not per
    /// request).
    pub fn new(
        source: &str,
        bos_token: Option<&str>,
        eos_token: Option<&str>,
    ) -> Result<Self, ChatError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(TEMPLATE_NAME, source.to_owned())
            .map_err(|e| ChatError::BadTemplate(describe(&e)))?;
        Ok(Self {
            env,
            bos_token: bos_token.unwrap_or_default().to_owned(),
            eos_token: eos_token.unwrap_or_default().to_owned(),
        })
    }

    /// The prompt text for `messages`, ending with the assistant's turn opened
    /// (`add_generation_prompt`).
    pub fn render(&self, messages: &[ChatMessage]) -> Result<String, ChatError> {
        let tmpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| ChatError::BadTemplate(describe(&e)))?;
        tmpl.render(minijinja::context! {
            messages => Value::from_serialize(messages),
            add_generation_prompt => true,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        })
        .map_err(|e| ChatError::Render(describe(&e)))
    }
}

/// The rendering used where a model has no chat template: `role: content\n` per message,
/// then `assistant: `. Not any model's format; it keeps equal conversations equal and a
/// conversation's rendering a prefix of its continuation's, which is what prefix routing
/// needs.
pub fn render_plain(messages: &[ChatMessage]) -> String {
    let mut out = String::new();
    for m in messages {
        out.push_str(&m.role);
        out.push_str(": ");
        out.push_str(m.content.as_deref().unwrap_or(""));
        out.push('\n');
    }
    out.push_str("assistant: ");
    out
}

/// An error with its causes (minijinja puts the useful part in the source chain).
fn describe(e: &JinjaError) -> String {
    let mut s = e.to_string();
    let mut cur = std::error::Error::source(e);
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// `raise_exception(msg)`: templates call it to refuse a conversation.
fn raise_exception(msg: String) -> Result<Value, JinjaError> {
    Err(JinjaError::new(ErrorKind::InvalidOperation, msg))
}

/// `strftime_now(fmt)`: the current UTC time (Llama 3.1+ templates print the date).
fn strftime_now(fmt: String) -> Result<String, JinjaError> {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    strftime(&fmt, secs)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

const DAYS: [&str; 7] = [
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
    "Monday",
    "Tuesday",
    "Wednesday",
];

/// Formats `unix_secs` (UTC) with the strftime directives templates use:
/// `%Y %y %m %d %e %B %b %A %a %H %M %S %j %%`. Others are an error.
pub(crate) fn strftime(fmt: &str, unix_secs: u64) -> Result<String, JinjaError> {
    let days = unix_secs / 86_400;
    let rem = unix_secs % 86_400;
    let (year, month, day) = civil_from_days(days as i64);
    let weekday = DAYS[(days % 7) as usize];
    let month_name = MONTHS[(month - 1) as usize];
    let yday = days_before_month(year, month) + day;
    let mut out = String::with_capacity(fmt.len() + 16);
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:2}")),
            Some('B') => out.push_str(month_name),
            Some('b') => out.push_str(&month_name[..3]),
            Some('A') => out.push_str(weekday),
            Some('a') => out.push_str(&weekday[..3]),
            Some('H') => out.push_str(&format!("{:02}", rem / 3600)),
            Some('M') => out.push_str(&format!("{:02}", rem / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", rem % 60)),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('%') => out.push('%'),
            other => {
                return Err(JinjaError::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now: unsupported directive %{}",
                        other.unwrap_or(' ')
                    ),
                ))
            }
        }
    }
    Ok(out)
}

/// (year, month 1-12, day 1-31) of a count of days since 1970-01-01 (the proleptic
/// Gregorian calendar; Howard Hinnant's `civil_from_days`).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// Days in the months of `year` before `month`.
fn days_before_month(year: i64, month: u32) -> u32 {
    const CUM: [u32; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    CUM[(month - 1) as usize] + u32::from(leap && month > 2)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_matches_known_dates() {
        // 2024-02-29 13:05:09 UTC, a Thursday.
        let t = 1_709_211_909;
        assert_eq!(strftime("%d %b %Y", t).unwrap(), "29 Feb 2024");
        assert_eq!(
            strftime("%A %B %e %H:%M:%S %j %y %%", t).unwrap(),
            "Thursday February 29 13:05:09 060 24 %"
        );
        assert_eq!(strftime("%Y-%m-%d %a", 0).unwrap(), "1970-01-01 Thu");
        assert!(strftime("%Q", 0).is_err());
    }

    #[test]
    fn plain_rendering_lists_roles() {
        let m = [
            ChatMessage::new("system", "be brief"),
            ChatMessage::new("user", "hi"),
        ];
        assert_eq!(render_plain(&m), "system: be brief\nuser: hi\nassistant: ");
    }

    #[test]
    fn raise_exception_fails_the_render() {
        let t = ChatTemplate::new("{{ raise_exception('no system role') }}", None, None).unwrap();
        let e = t.render(&[]).unwrap_err();
        assert!(
            matches!(&e, ChatError::Render(m) if m.contains("no system role")),
            "{e}"
        );
        assert!(matches!(
            ChatTemplate::new("{% if %}", None, None),
            Err(ChatError::BadTemplate(_))
        ));
    }
}
