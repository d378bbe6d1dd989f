//go:build kvrdebug

package kvr

// debugMode: this build (-tags kvrdebug) forces runtime.GC() before and after every cgo
// call, so a handle or slice missing its runtime.KeepAlive, or a finalizer that runs too
// early, fails loudly instead of once in a blue moon.
const debugMode = true
