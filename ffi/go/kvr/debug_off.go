//go:build !kvrdebug

package kvr

// debugMode is false in normal builds: gc() compiles to nothing.
const debugMode = false
