module github.com/kvr-dev/kvr/ffi/go/kvr

go 1.19
