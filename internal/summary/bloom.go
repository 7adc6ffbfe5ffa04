package summary

import "math/bits"

// bloom is a Bloom filter of 24 bits per key and 8 probes (about one false
// positive in 24,000 lookups), over 64-bit hashes. A false positive costs
// its claim a read of a past partition and statements that name it, which
// each connection prepares on first use: with 16 bits per key (one in
// 1,800, 1.7% of keys over 31 partitions) redeliveries of recent keys ran
// at 0.81x of the plain table's rate, with 24 at 0.94-1.03x.
//
// Each probe's bit is drawn from the key's hash by a mixing function of its
// own (splitmix64's finaliser over the hash and the probe's index), not as
// h1 + i·h2: that scheme knows only m²/2 probe patterns, and in a small
// filter (a partition with a few keys) one key in a few hundred shared its
// pattern with a key held. For the same reason no filter is smaller than
// minBloomWords: two keys in 512 bits let through about one key in 10¹².
type bloom struct {
	bits []uint64
	m    uint64
}

const (
	bloomBits     = 24 // per key
	bloomProbes   = 8
	minBloomWords = 8
)

func newBloom(n int) *bloom {
	words := (n*bloomBits + 63) / 64
	if words < minBloomWords {
		words = minBloomWords
	}
	return &bloom{bits: make([]uint64, words), m: uint64(words) * 64}
}

// probe is the bit of the i-th probe of the hash h.
func (b *bloom) probe(h, i uint64) uint64 {
	z := h + (i+1)*0x9e3779b97f4a7c15
	z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
	z = (z ^ z>>27) * 0x94d049bb133111eb
	z ^= z >> 31
	hi, _ := bits.Mul64(z, b.m) // z·m/2⁶⁴: in [0, m), without a division
	return hi
}

func (b *bloom) add(h uint64) {
	for i := uint64(0); i < bloomProbes; i++ {
		p := b.probe(h, i)
		b.bits[p/64] |= 1 << (p % 64)
	}
}

func (b *bloom) has(h uint64) bool {
	for i := uint64(0); i < bloomProbes; i++ {
		p := b.probe(h, i)
		if b.bits[p/64]&(1<<(p%64)) == 0 {
			return false
		}
	}
	return true
}
