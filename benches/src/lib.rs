//! Shared helpers of the benchmark suites (workload builders live in each bench).
