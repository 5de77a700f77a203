// Package kvsum is the integrity check's hash of KV that a GPU computes at
// its memory's rate: a block's slot range is read as its canonical
// sequence of 8-byte words (global layer, K/V, global head, slot: the
// order in which the source and the target of any TP/PP shapes agree), and
// word i of value w adds Term(w, i) to the block's sum, modulo 2^64.
//
// Unlike a streaming hash (xxhash64, the check's other scheme) the sum
// needs no order: any thread may add any word, so one kernel launch hashes
// a whole check from the engine's own layout, without first gathering the
// bytes into canonical order in host memory (which took the check in the
// pause 50–70 ms a side for ~0.75 GB on an H100). Term is a bijection of w
// for each i, so a single changed word always changes the sum, and the
// position keys make moved or swapped words show (as a random 64-bit
// value would: this is a check against copy bugs and stale mappings, not
// against an adversary).
package kvsum

import "encoding/binary"

// Scheme is the name under which the Host asks the agents for this hash.
const Scheme = "kvsum64"

// k keys a word's position (2^64 / φ, odd).
const k = 0x9E3779B97F4A7C15

// fmix64 is MurmurHash3's 64-bit finalizer: a bijection that spreads
// every input bit over the output.
func fmix64(x uint64) uint64 {
	x ^= x >> 33
	x *= 0xFF51AFD7ED558CCD
	x ^= x >> 33
	x *= 0xC4CEB9FE1A85EC53
	x ^= x >> 33
	return x
}

// Term is what word w at canonical position i adds to its block's sum.
func Term(w, i uint64) uint64 { return fmix64(w ^ i*k) }

// Add adds the words of b (little-endian; len(b) a multiple of 8), the
// first at canonical position i, to sum.
func Add(sum uint64, b []byte, i uint64) uint64 {
	for len(b) >= 8 {
		sum += Term(binary.LittleEndian.Uint64(b), i)
		b, i = b[8:], i+1
	}
	return sum
}

// Finish turns the sum of a block's words (n of them) into its hash.
func Finish(sum, n uint64) uint64 { return fmix64(sum ^ n*k) }
