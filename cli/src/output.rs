//! A command's output on stdout. A reader that closes the pipe early (`kvr replay | head
//! -1`) already has what it wanted, so a broken pipe ends the output quietly with success
//! (`println!` would panic and exit 101); any other write error is reported.

use std::io::{self, Write};

/// Writes `text` to stdout and flushes it; a broken pipe is not an error.
pub(crate) fn emit(text: &str) -> Result<(), String> {
    let mut out = io::stdout().lock();
    quiet_on_broken_pipe(out.write_all(text.as_bytes()).and_then(|()| out.flush()))
}

fn quiet_on_broken_pipe(r: io::Result<()>) -> Result<(), String> {
    match r {
        Err(e) if e.kind() != io::ErrorKind::BrokenPipe => {
            Err(format!("cannot write to stdout: {e}"))
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broken_pipe_is_quiet_other_errors_are_not() {
        assert_eq!(quiet_on_broken_pipe(Ok(())), Ok(()));
        let pipe = io::Error::from(io::ErrorKind::BrokenPipe);
        assert_eq!(quiet_on_broken_pipe(Err(pipe)), Ok(()));
        let full = io::Error::other("disk full");
        let err = quiet_on_broken_pipe(Err(full)).unwrap_err();
        assert!(err.contains("disk full"), "{err}");
    }
}
