package main

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/pgidem/idem/internal/catalog"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// idem keys on both layouts: each state a key can be in, written straight
// into the table (a claim in flight: an open transaction that holds the
// key's lock and has inserted its row), and each refusal of forget.
func TestKeysCLI(t *testing.T) {
	c := cli{t: t, bin: build(t, t.TempDir())}
	for _, layout := range []struct{ name, interval string }{{"plain", "0"}, {"partitioned", "24h"}} {
		t.Run("on a "+layout.name+" table", func(t *testing.T) {
			c := cli{t, c.bin}
			t.Parallel()
			table := fmt.Sprintf("cmd_keys_%d", tableSeq.Add(1))
			r := c.run(testURL, "migrate", "-table", table, "-partition-interval", layout.interval)
			require.Equal(t, 0, r.code, "%+v", r)
			// Every key claimed seconds ago, so that a partitioned
			// table's current partition holds it whenever this runs.
			_, err := testDB.Exec(`INSERT INTO "` + table + `" (source, event_id, payload_digest, response_status, response_headers, response_body,
    claimed_at, completed_at, lease_until, lease_token) VALUES
('test', 'done', sha256('{}'::bytea), 200, '{"Content-Type": ["application/json"]}', '{"ok":true}', now() - interval '5 seconds', now() - interval '4 seconds', NULL, NULL),
('test', 'unanswered', '\x00', NULL, NULL, NULL, now() - interval '4 seconds', NULL, NULL, NULL),
('test', 'expired', '\x00', NULL, NULL, NULL, now() - interval '3 seconds', NULL, now() - interval '1 second', 1),
('test', 'leased', '\x00', NULL, NULL, NULL, now() - interval '2 seconds', NULL, now() + interval '1 hour', 2),
('test', '<script>alert(1)</script>', '\x00', 204, '{}', '', now() - interval '1 second', now(), NULL, NULL)`)
			require.NoError(t, err)

			// A claim in flight of "test"/"flying".
			ctx := context.Background()
			conn, err := testDB.Conn(ctx)
			require.NoError(t, err)
			defer conn.Close()
			tx, err := conn.BeginTx(ctx, nil)
			require.NoError(t, err)
			defer func() { _ = tx.Rollback() }()
			_, err = tx.Exec(`SELECT pg_advisory_xact_lock($1)`, catalog.LockID(table, "test", "flying"))
			require.NoError(t, err)
			_, err = tx.Exec(`INSERT INTO "` + table + `" (source, event_id, payload_digest) VALUES ('test', 'flying', '\x00')`)
			require.NoError(t, err)

			keys := func(args ...string) result {
				return c.run(testURL, append(append([]string{"keys"}, args...), "-table", table)...)
			}
			show := func(id string, extra ...string) result {
				return keys(append([]string{"show", "-source", "test", "-id", id}, extra...)...)
			}

			t.Run("show says each key's state", func(t *testing.T) {
				for id, want := range map[string]string{
					"done": "state: completed", "unanswered": "state: unanswered", "expired": "state: lease expired",
					"leased": "state: leased", "flying": "state: in flight",
				} {
					r := show(id)
					assert.Equal(t, exitOK, r.code, "%s: %+v", id, r)
					assert.Contains(t, r.stdout, want, id)
					assert.Empty(t, r.stderr)
				}
				r := show("done")
				for _, w := range []string{`key: source "test" event_id "done"`, "status: 200", `Content-Type: "application/json"`, "body: 11 bytes",
					"request body sha256: 44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a", "completed: "} {
					assert.Contains(t, r.stdout, w)
				}
				assert.NotContains(t, r.stdout, `{"ok":true}`, "no body without -body")
				assert.Contains(t, show("done", "-body").stdout, "body:\n{\"ok\":true}\n")
				assert.Contains(t, show("leased").stdout, "lease until: ")
				if layout.name == "partitioned" {
					assert.Contains(t, r.stdout, "partition: "+table+"_p")
				}
			})
			t.Run("show -json", func(t *testing.T) {
				r := show("done", "-json", "-body")
				require.Equal(t, exitOK, r.code, "%+v", r)
				var d map[string]any
				require.NoError(t, json.Unmarshal([]byte(r.stdout), &d))
				assert.Equal(t, true, d["found"])
				assert.Equal(t, "completed", d["state"])
				assert.Equal(t, float64(200), d["status"])
				assert.Equal(t, `{"ok":true}`, d["body"])
				assert.Equal(t, float64(11), d["body_bytes"])
				assert.Equal(t, map[string]any{"Content-Type": []any{"application/json"}}, d["headers"])
				assertStamp(t, d["claimed_at"])
				assertStamp(t, d["completed_at"])
				assert.Nil(t, d["lease_until"])
				assert.Nil(t, d["lock_holder_pid"])

				r = show("flying", "-json")
				require.Equal(t, exitOK, r.code, "%+v", r)
				d = nil
				require.NoError(t, json.Unmarshal([]byte(r.stdout), &d))
				assert.Equal(t, "in_flight", d["state"])
				assert.Positive(t, d["lock_holder_pid"])
				assert.Nil(t, d["claimed_at"])
				assert.NotContains(t, d, "body")
			})
			t.Run("a key never seen: exit 4, not an error", func(t *testing.T) {
				r := show("never")
				assert.Equal(t, exitNotFound, r.code, "%+v", r)
				assert.Contains(t, r.stdout, "no key")
				assert.Empty(t, r.stderr)
				r = show("never", "-json")
				assert.Equal(t, exitNotFound, r.code)
				assert.JSONEq(t, `{"found": false, "source": "test", "event_id": "never"}`, r.stdout)
				r = keys("forget", "-source", "test", "-id", "never")
				assert.Equal(t, exitNotFound, r.code, "%+v", r)
			})
			t.Run("list by state, newest first", func(t *testing.T) {
				for state, want := range map[string][]string{
					"all":        {"<script>alert(1)</script>", "leased", "expired", "unanswered", "done"},
					"unanswered": {"unanswered"},
					"stuck":      {"expired", "unanswered"},
					"leased":     {"leased"},
					"expired":    {"expired"},
				} {
					r := keys("list", "-state", state, "-json")
					require.Equal(t, exitOK, r.code, "%s: %+v", state, r)
					var docs []map[string]any
					require.NoError(t, json.Unmarshal([]byte(r.stdout), &docs))
					var ids []string
					for _, d := range docs {
						ids = append(ids, d["event_id"].(string))
					}
					assert.Equal(t, want, ids, state)
				}
				r := keys("list", "-state", "stuck")
				assert.Equal(t, exitOK, r.code)
				assert.Contains(t, r.stdout, "SOURCE")
				assert.Contains(t, r.stdout, "lease_expired")
				assert.Equal(t, 3, strings.Count(r.stdout, "\n"), r.stdout)
				r = keys("list", "-limit", "2")
				assert.Contains(t, r.stdout, "(the newest 2;")
				assert.Contains(t, r.stdout, "test    <script>alert(1)</script>  completed")
				_, err = testDB.Exec(`INSERT INTO "` + table + `" (source, event_id, payload_digest, claimed_at) VALUES ('a b', 'x'||chr(27)||'[2J', '\x00', now())`)
				require.NoError(t, err)
				r = keys("list", "-state", "unanswered", "-limit", "1")
				assert.Regexp(t, `"a b" +"x\\x1b\[2J" +unanswered`, r.stdout, "quoted: a space, an escape sequence")
				r = keys("forget", "-source", "a b", "-id", "x\x1b[2J")
				require.Equal(t, exitOK, r.code, "%+v", r)
				r = keys("list", "-source", "nobody")
				assert.Equal(t, "no all keys\n", r.stdout)
				assertOneLineError(t, keys("list", "-state", "done"), "idem keys list: ", `unknown state "done"`)
				assertOneLineError(t, keys("list", "-limit", "0"), "idem keys list: ", "-limit")
			})
			t.Run("forget refuses a live lease and a claim in flight, and -force overrides the lease", func(t *testing.T) {
				r := keys("forget", "-source", "test", "-id", "leased")
				assert.Equal(t, exitRefused, r.code, "%+v", r)
				assert.Contains(t, r.stderr, "refused")
				assert.Contains(t, r.stderr, "live lease")
				assert.Empty(t, r.stdout)
				r = keys("forget", "-source", "test", "-id", "flying", "-json")
				assert.Equal(t, exitRefused, r.code, "%+v", r)
				assert.Contains(t, r.stdout, `"removed": false`)
				r = keys("forget", "-source", "test", "-id", "flying", "-force")
				assert.Equal(t, exitRefused, r.code, "a claim in flight has no row to delete, forced or not: %+v", r)
				assert.Equal(t, exitOK, show("leased").code, "still there")

				r = keys("forget", "-source", "test", "-id", "leased", "-force", "-reason", "INC-7", "-actor", "bob")
				assert.Equal(t, exitOK, r.code, "%+v", r)
				assert.Contains(t, r.stdout, `forgot key source "test" event_id "leased" (forced): it was leased`)
				assert.Contains(t, r.stderr, `msg="idem: key forgotten"`)
				assert.Contains(t, r.stderr, "actor=bob")
				assert.Contains(t, r.stderr, "reason=INC-7")
				assert.Contains(t, r.stderr, "forced=true")
				assert.Equal(t, exitNotFound, show("leased").code)
			})
			t.Run("forget deletes a completed key and says what it removed", func(t *testing.T) {
				r := keys("forget", "-source", "test", "-id", "done", "-json")
				require.Equal(t, exitOK, r.code, "%+v", r)
				var d forgottenDoc
				require.NoError(t, json.Unmarshal([]byte(r.stdout), &d))
				assert.True(t, d.Removed)
				assert.False(t, d.Forced)
				assert.Equal(t, "completed", d.Key.State)
				assert.Equal(t, 200, *d.Key.Status)
				assert.Contains(t, r.stderr, `event_id=done`)
				assert.Equal(t, exitNotFound, show("done").code)
				for _, id := range []string{"unanswered", "expired"} {
					r := keys("forget", "-source", "test", "-id", id)
					assert.Equal(t, exitOK, r.code, "%s: %+v", id, r)
				}
			})
			t.Run("usage errors", func(t *testing.T) {
				assertOneLineError(t, keys("show", "-source", "test"), "idem keys show: ", "-source and -id are required")
				assertOneLineError(t, c.run(testURL, "keys"), "idem keys: ", "show, list or forget")
				assertOneLineError(t, c.run(testURL, "keys", "drop"), "idem: ", `unknown command "keys drop"`)
				r := c.run("", "keys", "forget", "-h")
				assert.Equal(t, 0, r.code)
				for _, w := range []string{"Usage: idem keys forget", "-force", "-reason", "5 keys forget: refused"} {
					assert.Contains(t, r.stdout, w)
				}
			})
		})
	}
}
