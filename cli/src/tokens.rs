//! Token input: u32 decimal tokens from arguments or from text (stdin).

use std::fmt;

/// A token that is not a u32 in plain decimal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BadToken {
    /// 1-based position among all tokens of the input.
    pub position: usize,
    /// The token as written.
    pub text: String,
    pub reason: BadTokenReason,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BadTokenReason {
    NotANumber,
    Negative,
    TooLarge,
}

impl fmt::Display for BadToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let why = match self.reason {
            BadTokenReason::NotANumber => "is not a decimal number",
            BadTokenReason::Negative => "is negative",
            BadTokenReason::TooLarge => "is larger than u32::MAX (4294967295)",
        };
        write!(
            f,
            "bad token at position {}: {:?} {why}; tokens must be u32 decimal integers",
            self.position, self.text
        )
    }
}

impl std::error::Error for BadToken {}

/// Parses one token; `position` is 1-based and only used for the error.
pub(crate) fn parse_token(text: &str, position: usize) -> Result<u32, BadToken> {
    let bad = |reason| BadToken {
        position,
        text: text.to_owned(),
        reason,
    };
    let digits = text.strip_prefix('-');
    let is_decimal = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    match digits {
        Some(d) if is_decimal(d) => Err(bad(BadTokenReason::Negative)),
        Some(_) => Err(bad(BadTokenReason::NotANumber)),
        None if !is_decimal(text) => Err(bad(BadTokenReason::NotANumber)),
        // All ASCII digits: the only way `parse` can fail is overflow.
        None => text.parse().map_err(|_| bad(BadTokenReason::TooLarge)),
    }
}

/// Parses a list of separate token strings (command-line arguments).
pub(crate) fn parse_tokens<S: AsRef<str>>(items: &[S]) -> Result<Vec<u32>, BadToken> {
    items
        .iter()
        .enumerate()
        .map(|(i, s)| parse_token(s.as_ref(), i + 1))
        .collect()
}

/// Parses text holding tokens separated by any mix of whitespace and commas.
/// Empty fields (e.g. `1,,2` or a trailing comma) are skipped.
pub(crate) fn parse_token_text(text: &str) -> Result<Vec<u32>, BadToken> {
    text.split(|c: char| c == ',' || c.is_whitespace())
        .filter(|s| !s.is_empty())
        .enumerate()
        .map(|(i, s)| parse_token(s, i + 1))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_u32_range() {
        assert_eq!(parse_token("0", 1), Ok(0));
        assert_eq!(parse_token("007", 1), Ok(7));
        assert_eq!(parse_token("4294967295", 1), Ok(u32::MAX));
    }

    #[test]
    fn classifies_bad_tokens() {
        let reason = |s| parse_token(s, 1).unwrap_err().reason;
        assert_eq!(reason("abc"), BadTokenReason::NotANumber);
        assert_eq!(reason(""), BadTokenReason::NotANumber);
        assert_eq!(reason("+5"), BadTokenReason::NotANumber);
        assert_eq!(reason("1.5"), BadTokenReason::NotANumber);
        assert_eq!(reason("-"), BadTokenReason::NotANumber);
        assert_eq!(reason("-x"), BadTokenReason::NotANumber);
        assert_eq!(reason("-1"), BadTokenReason::Negative);
        assert_eq!(reason("4294967296"), BadTokenReason::TooLarge);
        assert_eq!(reason("99999999999999999999999"), BadTokenReason::TooLarge);
    }

    #[test]
    fn text_splits_on_mixed_separators() {
        assert_eq!(
            parse_token_text(" 1,2\n3\t4 ,, 5,\r\n"),
            Ok(vec![1, 2, 3, 4, 5])
        );
        assert_eq!(parse_token_text(""), Ok(vec![]));
        assert_eq!(parse_token_text(" \n,\t"), Ok(vec![]));
    }

    #[test]
    fn error_names_position_and_token() {
        let e = parse_token_text("1, 2,\nxyz 4").unwrap_err();
        assert_eq!(e.position, 3);
        assert_eq!(e.text, "xyz");
        let msg = e.to_string();
        assert!(
            msg.contains("position 3") && msg.contains("\"xyz\""),
            "{msg}"
        );
    }
}
