package idem

import (
	"bytes"
	"fmt"
	"github.com/stretchr/testify/require"
	"net/http"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

func answer(body string) *stored {
	return &stored{digest: make([]byte, 32), status: 200, header: http.Header{"Content-Type": {"text/plain"}}, body: []byte(body)}
}

func TestReplayCacheEvictsLeastRecentlyUsedByBytes(t *testing.T) {
	now := time.Unix(0, 0)
	one := entrySize(Key{"s", "a"}, answer(strings.Repeat("x", 500)))
	c := newReplayCache(8*one+one/2, time.Minute) // room for 8
	for i := 0; i < 20; i++ {
		c.put(Key{"s", string(rune('a' + i))}, answer(strings.Repeat("x", 500)), now)
		_, ok := c.get(Key{"s", "a"}, now) // keep "a" recently used
		assert.True(t, ok, "a stays while it is used")
	}
	assert.LessOrEqual(t, c.size, c.max)
	assert.Less(t, c.len(), 20, "older entries were evicted")
	_, ok := c.get(Key{"s", "b"}, now)
	assert.False(t, ok, "b was the least recently used")
	_, ok = c.get(Key{"s", string(rune('a' + 19))}, now)
	assert.True(t, ok, "the newest entry is there")
}

func TestReplayCacheEntriesExpire(t *testing.T) {
	now := time.Unix(0, 0)
	c := newReplayCache(1<<20, time.Second)
	c.put(Key{"s", "e"}, answer("x"), now)
	_, ok := c.get(Key{"s", "e"}, now.Add(time.Second))
	assert.True(t, ok)
	_, ok = c.get(Key{"s", "e"}, now.Add(time.Second+1))
	assert.False(t, ok)
	assert.Zero(t, c.len())
	assert.Zero(t, c.size)
}

func TestReplayCacheSkipsHugeAnswersAndCanBeOff(t *testing.T) {
	now := time.Unix(0, 0)
	c := newReplayCache(8000, time.Minute)
	c.put(Key{"s", "big"}, answer(strings.Repeat("x", 1001)), now)
	assert.Zero(t, c.len(), "an answer over an eighth of the cache is not kept")

	off := newReplayCache(-1, time.Minute)
	off.put(Key{"s", "e"}, answer("x"), now)
	_, ok := off.get(Key{"s", "e"}, now)
	assert.False(t, ok)
}

// The cache's size is what it holds on the heap: filled with 200,000 small
// answers, as the database hands them back (each key's strings, digest,
// body and parsed headers allocated on their own), its live heap stays
// within 1.2x of its setting, and near it. Not parallel: it measures the
// heap.
func TestReplayCacheHoldsWhatItsSettingSays(t *testing.T) {
	const setting = 16 << 20
	heap := func() int64 {
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		return int64(ms.HeapAlloc)
	}
	now := time.Unix(0, 0)
	before := heap()
	c := newReplayCache(setting, time.Minute)
	for i := range 200_000 {
		h, err := parseHeaderJSON([]byte(`{"Content-Type": ["application/json"]}`))
		require.NoError(t, err)
		s := &stored{digest: bytes.Repeat([]byte{byte(i)}, 32), status: 200, header: h,
			body: fmt.Appendf(nil, `{"ok":true,"payment":"pay_%08d"}`, i)}
		c.put(Key{Source: strings.Clone("stripe POST /webhooks/stripe"), EventID: fmt.Sprintf("evt_%020d", i)}, s, now)
	}
	held := heap() - before
	t.Logf("%d entries, counted %.1f MiB, %.1f MiB on the heap (setting %d MiB)", c.len(), float64(c.size)/(1<<20), float64(held)/(1<<20), setting>>20)
	assert.LessOrEqual(t, float64(held), 1.2*setting, "the cache holds no more than its setting")
	assert.GreaterOrEqual(t, float64(held), 0.5*setting, "and uses what it is given")
	runtime.KeepAlive(c)
}
