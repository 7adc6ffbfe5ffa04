package idem

import (
	"net/http"
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
	c := newReplayCache(8*(entryOverhead+600), time.Minute)
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
