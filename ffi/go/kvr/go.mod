module kvr/ffi/go/kvr

go 1.19
