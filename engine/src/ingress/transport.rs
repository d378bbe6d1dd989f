//! ZMQ SUB (+ DEALER replay) transport. (Being written.)
