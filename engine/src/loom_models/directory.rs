//! Loom model of the rank directory's growth (`index::directory`): a new rank's slot past
//! the directory's end makes the writer copy it into a larger array and retire the old
//! one while a reader may still be translating through it.

use super::{block, churn_epoch, in_child, index_holding, model, must_fail};
use crate::ids::{RankId, Tier};
use crate::sync::faults::{self, Faults};

/// Rank `a` holds block 100; rank `b` is created (slot 1: under loom the directory starts
/// with one cell, so it grows) while a reader translates `a`'s slot. The reader credits
/// `a` with its block, whichever array it read, and the outgrown array is freed only after
/// it.
fn directory_grows_under_a_reader() {
    let (a, b) = (RankId::new(1, 0), RankId::new(2, 0));
    let frees = faults::directory_frees();
    let index = index_holding(a, block(1, 100));
    let cells = index.directory_capacity();
    let w = index.clone();
    let writer = loom::thread::spawn(move || {
        w.store(b, Tier::Device, None, &[block(2, 200)]).unwrap();
        churn_epoch();
    });
    let m = index.find_matches(&[100]);
    assert_eq!(
        m.as_slice(),
        &[(a, 1)],
        "mistranslated: a live rank's slot read through a growing directory"
    );
    writer.join().unwrap();
    assert!(
        index.directory_capacity() > cells,
        "the model must grow the directory"
    );
    assert_eq!(index.find_matches(&[200]).as_slice(), &[(b, 1)]);
    churn_epoch();
    if faults::directory_frees() > frees {
        faults::note_reclaiming_run();
    }
}

#[test]
fn rank_directory_growth() {
    in_child("loom_models::directory::rank_directory_growth", || {
        let runs = faults::reclaiming_runs();
        model(directory_grows_under_a_reader);
        assert!(
            faults::reclaiming_runs() > runs,
            "no explored execution freed the outgrown directory"
        );
    });
}

#[test]
fn rank_directory_growth_negative_free_now() {
    must_fail(
        "loom_models::directory::rank_directory_growth_negative_free_now",
        Faults {
            free_directory_now: true,
            ..Faults::default()
        },
        "Causality violation",
        directory_grows_under_a_reader,
    );
}
