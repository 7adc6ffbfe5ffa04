package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"database/sql"
	"debug/buildinfo"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/debug"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

// The CLI is tested as its users run it: the binary is built once into a
// temporary directory and run against a PostgreSQL database of this test
// binary's own (created here, dropped at the end), one table per test.
// Without PostgreSQL the tests fail; they never skip.

const defaultAdminURL = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"

var (
	testURL  string // the test database, set by TestMain
	testDB   *sql.DB
	tableSeq atomic.Int64
)

func adminURL() string {
	if u := os.Getenv("DATABASE_URL"); u != "" {
		return u
	}
	return defaultAdminURL
}

func TestMain(m *testing.M) {
	name, err := createDatabase()
	if err != nil {
		fmt.Fprintln(os.Stderr, "idem cmd tests: PostgreSQL is required (set DATABASE_URL):", err)
		os.Exit(1)
	}
	code := m.Run()
	testDB.Close()
	if err := adminExec("DROP DATABASE IF EXISTS " + name + " WITH (FORCE)"); err != nil {
		fmt.Fprintln(os.Stderr, "idem cmd tests: drop test database:", err)
	}
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "idem cmd tests: leaked goroutines:", err)
			code = 1
		}
	}
	os.Exit(code)
}

func adminExec(stmt string) error {
	admin, err := sql.Open("pgx", adminURL())
	if err != nil {
		return err
	}
	defer admin.Close()
	_, err = admin.Exec(stmt)
	return err
}

func createDatabase() (string, error) {
	var b [6]byte
	_, _ = rand.Read(b[:])
	name := "idem_cmd_test_" + hex.EncodeToString(b[:])
	if err := adminExec("CREATE DATABASE " + name); err != nil {
		return "", err
	}
	u, err := url.Parse(adminURL())
	if err != nil {
		return "", err
	}
	u.Path = "/" + name
	testURL = u.String()
	if testDB, err = sql.Open("pgx", testURL); err != nil {
		return "", err
	}
	return name, testDB.Ping()
}

// cli runs the built binary.
type cli struct {
	t   *testing.T
	bin string
}

type result struct {
	code           int
	stdout, stderr string
}

// run runs the binary with args and DATABASE_URL set to env.
func (c cli) run(env string, args ...string) result {
	c.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, c.bin, args...)
	cmd.Env = append(os.Environ(), "DATABASE_URL="+env)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	var exit *exec.ExitError
	if err != nil && !errors.As(err, &exit) {
		c.t.Fatalf("running idem %v: %v", args, err)
	}
	return result{cmd.ProcessState.ExitCode(), stdout.String(), stderr.String()}
}

// table returns a new table name, migrated by the binary.
func (c cli) table() string {
	c.t.Helper()
	name := fmt.Sprintf("cmd_%d", tableSeq.Add(1))
	r := c.run(testURL, "migrate", "-table", name)
	require.Equal(c.t, 0, r.code, "migrate: %+v", r)
	return name
}

// build compiles the command into dir.
func build(t *testing.T, dir string) string {
	t.Helper()
	goTool, err := exec.LookPath("go")
	if err != nil {
		goTool = filepath.Join(os.Getenv("GOROOT"), "bin", "go")
	}
	bin := filepath.Join(dir, "idem")
	out, err := exec.Command(goTool, "build", "-o", bin, ".").CombinedOutput()
	require.NoError(t, err, "go build: %s", out)
	return bin
}

// insert commits keys of source "test": n named "<prefix><i>", claimed age
// ago, completed unless unanswered.
func insert(t *testing.T, table, prefix string, n int, age time.Duration, unanswered bool) {
	t.Helper()
	_, err := testDB.Exec(`INSERT INTO "`+table+`" (source, event_id, payload_digest, response_status, claimed_at, completed_at)
SELECT 'test', $1 || g, '\x00', 200, now() - $2::bigint * interval '1 microsecond',
       CASE WHEN $3 THEN NULL ELSE now() END
FROM generate_series(1, $4::int) AS g`, prefix, age.Microseconds(), unanswered, n)
	require.NoError(t, err)
}

func count(t *testing.T, table string) int {
	t.Helper()
	var n int
	require.NoError(t, testDB.QueryRow(`SELECT count(*) FROM "`+table+`"`).Scan(&n))
	return n
}

// assertOneLineError checks a failure: exit code 3, nothing on stdout, one
// line on stderr that starts with prefix and contains want.
func assertOneLineError(t *testing.T, r result, prefix string, want ...string) {
	t.Helper()
	assert.Equal(t, exitFailed, r.code, "%+v", r)
	assert.Empty(t, r.stdout)
	assert.True(t, strings.HasPrefix(r.stderr, prefix), "stderr %q should start with %q", r.stderr, prefix)
	assert.Equal(t, 1, strings.Count(r.stderr, "\n"), "one line: %q", r.stderr)
	for _, w := range want {
		assert.Contains(t, r.stderr, w)
	}
}

const day = 24 * time.Hour

func TestCLI(t *testing.T) {
	c := cli{t: t, bin: build(t, t.TempDir())}

	t.Run("-h lists the commands and the exit codes", func(t *testing.T) {
		c := cli{t, c.bin}
		t.Parallel()
		r := c.run("", "-h")
		assert.Equal(t, 0, r.code)
		for _, w := range []string{"migrate", "sweep", "check", "stats", "version", "-json", "-database-url", "DATABASE_URL", "Exit codes", "2  check found critical"} {
			assert.Contains(t, r.stdout, w)
		}
		for _, sub := range []string{"migrate", "sweep", "check", "stats"} {
			r := c.run("", sub, "-h")
			assert.Equal(t, 0, r.code, sub)
			assert.Contains(t, r.stdout, "Usage: idem "+sub, sub)
			assert.Contains(t, r.stdout, "-database-url", sub)
			assert.Contains(t, r.stdout, "-table", sub)
			assert.Contains(t, r.stdout, "Exit codes", sub)
		}
		r = c.run("", "sweep", "-h")
		for _, w := range []string{"-retention", "-batch", "-max-batches", "-pause", "-unsafe-short-retention", "720h0m0s", "5000"} {
			assert.Contains(t, r.stdout, w)
		}
		r = c.run("", "check", "-h")
		for _, w := range []string{"-horizon", "-retention", "-stuck-after", "72h0m0s", "-json"} {
			assert.Contains(t, r.stdout, w)
		}
		assert.Contains(t, c.run("", "stats", "-h").stdout, "-json")
		r = c.run("", "version", "-h")
		assert.Equal(t, 0, r.code)
		assert.Contains(t, r.stdout, "Usage: idem version")
	})

	t.Run("usage errors are one line and exit 3", func(t *testing.T) {
		c := cli{t, c.bin}
		t.Parallel()
		assertOneLineError(t, c.run(testURL), "idem: missing command")
		assertOneLineError(t, c.run(testURL, "vacuum"), `idem: unknown command "vacuum"`)
		assertOneLineError(t, c.run(testURL, "sweep", "-nope"), "idem sweep: ", "-nope", "idem sweep -h")
		assertOneLineError(t, c.run(testURL, "check", "extra"), "idem check: ", `unexpected argument "extra"`)
		assertOneLineError(t, c.run(testURL, "sweep", "-batch", "0"), "idem sweep: ", "-batch")
		assertOneLineError(t, c.run(testURL, "check", "-horizon", "0s"), "idem check: ", "-horizon must be positive")
	})

	t.Run("database problems are one line and exit 3", func(t *testing.T) {
		c := cli{t, c.bin}
		t.Parallel()
		assertOneLineError(t, c.run("", "stats"), "idem stats: ", "no database", "DATABASE_URL")
		assertOneLineError(t, c.run("", "check", "-database-url", "postgres://postgres@127.0.0.1:1/none?connect_timeout=5"),
			"idem check: connect: ")
		assertOneLineError(t, c.run(testURL, "check", "-table", "no_such_table"), "idem check: ", "does not exist", "migrate")
		assertOneLineError(t, c.run(testURL, "migrate", "-table", "a.b.c"), "idem migrate: ", "at most one dot")
	})

	t.Run("a multi-host URL without connect_timeout is warned of on stderr", func(t *testing.T) {
		c := cli{t, c.bin}
		t.Parallel()
		table := c.table()
		u, err := url.Parse(testURL)
		require.NoError(t, err)
		q := u.Query()
		q.Del("connect_timeout")
		u.RawQuery = q.Encode()
		u.Host += ",localhost:1" // never tried: the first host answers
		r := c.run(u.String(), "check", "-table", table)
		require.Equal(t, exitOK, r.code, "a warning, not a failure: %+v", r)
		assert.Contains(t, r.stderr, "idem check: warning: the connection string names 2 hosts")
		assert.Contains(t, r.stderr, "no connect_timeout")
		assert.Equal(t, 1, strings.Count(r.stderr, "\n"), "one line: %q", r.stderr)

		q.Set("connect_timeout", "5")
		u.RawQuery = q.Encode()
		r = c.run(u.String(), "check", "-table", table)
		require.Equal(t, exitOK, r.code, "%+v", r)
		assert.Empty(t, r.stderr)
	})

	t.Run("migrate creates the table, says so, and can run again", func(t *testing.T) {
		c := cli{t, c.bin}
		t.Parallel()
		// -database-url wins over DATABASE_URL.
		for _, want := range []string{"created table \"cmd_migrated\" with its index\n", "table \"cmd_migrated\" is up to date\n"} {
			r := c.run("postgres://nobody@127.0.0.1:1/none", "migrate", "-database-url", testURL, "-table", "cmd_migrated")
			require.Equal(t, 0, r.code, "%+v", r)
			assert.Equal(t, want, r.stdout)
		}
		var exists bool
		require.NoError(t, testDB.QueryRow(`SELECT to_regclass('cmd_migrated') IS NOT NULL`).Scan(&exists))
		assert.True(t, exists)
	})

	t.Run("migrate says what it added to an older table", func(t *testing.T) {
		c := cli{t, c.bin}
		t.Parallel()
		// The table as the first versions created it: no lease columns, no
		// claimed_at index.
		_, err := testDB.Exec(`CREATE TABLE cmd_old (
			source text NOT NULL, event_id text NOT NULL, payload_digest bytea NOT NULL,
			response_status smallint, response_headers jsonb, response_body bytea,
			claimed_at timestamptz NOT NULL DEFAULT now(), completed_at timestamptz,
			PRIMARY KEY (source, event_id))`)
		require.NoError(t, err)
		r := c.run(testURL, "migrate", "-table", "cmd_old")
		require.Equal(t, 0, r.code, "%+v", r)
		assert.Equal(t, "table \"cmd_old\" updated: added 2 columns, 1 index\n", r.stdout)
		r = c.run(testURL, "migrate", "-table", "cmd_old")
		assert.Equal(t, "table \"cmd_old\" is up to date\n", r.stdout)
	})

	t.Run("migrate refuses a table name that is not a lower-case identifier", func(t *testing.T) {
		c := cli{t, c.bin}
		t.Parallel()
		for _, name := range []string{"Cmd_Upper", `cmd"quote`, "cmd space", "cmd.", "ïdem"} {
			assertOneLineError(t, c.run(testURL, "migrate", "-table", name), "idem migrate: ", "a-z, 0-9 and _")
		}
	})

	t.Run("version prints what the build recorded", func(t *testing.T) {
		c := cli{t, c.bin}
		t.Parallel()
		r := c.run("", "version")
		require.Equal(t, 0, r.code, "%+v", r)
		assert.Empty(t, r.stderr)
		// What the go command reads from the same binary: the module's
		// version, and the VCS revision if this build recorded one
		// (GOFLAGS=-buildvcs=false does not).
		info, err := buildinfo.ReadFile(c.bin)
		require.NoError(t, err)
		assert.Equal(t, versionText(info), r.stdout)
		assert.True(t, strings.HasPrefix(r.stdout, "idem "+info.Main.Version+"\nmodule github.com/pgidem/idem\n"), r.stdout)
		rev := ""
		for _, s := range info.Settings {
			if s.Key == "vcs.revision" {
				rev = s.Value
			}
		}
		if rev != "" {
			assert.Contains(t, r.stdout, "revision "+rev)
		} else {
			assert.NotContains(t, r.stdout, "revision")
		}
		assert.Contains(t, r.stdout, "built with "+info.GoVersion+"\n")
		assert.Equal(t, r, c.run("", "--version"))
		assertOneLineError(t, c.run("", "version", "extra"), "idem version: ", `"extra"`)
	})

	t.Run("sweep removes expired keys and prints how many", func(t *testing.T) {
		c := cli{t, c.bin}
		t.Parallel()
		table := c.table()
		insert(t, table, "old_", 25, 31*day, false)
		insert(t, table, "new_", 5, day, false)

		r := c.run(testURL, "sweep", "-table", table, "-retention", "720h", "-batch", "10", "-max-batches", "2", "-pause", "0")
		require.Equal(t, 0, r.code, "%+v", r)
		assert.Contains(t, r.stdout, fmt.Sprintf("removed 20 expired keys from %q in 2 batches (retention 720h0m0s", table))
		assert.Contains(t, r.stdout, "stopped at -max-batches 2")
		assert.Equal(t, 1, strings.Count(r.stdout, "\n"))
		assert.Equal(t, 10, count(t, table))

		r = c.run(testURL, "sweep", "-table", table, "-retention", "720h", "-batch", "10", "-pause", "0")
		require.Equal(t, 0, r.code, "%+v", r)
		assert.Contains(t, r.stdout, "removed 5 expired keys")
		assert.NotContains(t, r.stdout, "stopped")
		assert.Equal(t, 5, count(t, table), "keys within the retention stay")
	})

	t.Run("sweep refuses a retention under 72h and says why", func(t *testing.T) {
		c := cli{t, c.bin}
		t.Parallel()
		table := c.table()
		insert(t, table, "h3_", 2, 3*time.Hour, false)
		r := c.run(testURL, "sweep", "-table", table, "-retention", "2h")
		assertOneLineError(t, r, "idem sweep: ", "2h0m0s is under 72h0m0s", "run the handler twice", "-unsafe-short-retention")
		assert.Equal(t, 2, count(t, table))

		r = c.run(testURL, "sweep", "-table", table, "-retention", "2h", "-unsafe-short-retention", "-pause", "0")
		require.Equal(t, 0, r.code, "%+v", r)
		assert.Contains(t, r.stdout, "removed 2 expired keys")
	})

	t.Run("check exits 0 when healthy, 1 on warnings, 2 on critical findings", func(t *testing.T) {
		c := cli{t, c.bin}
		t.Parallel()
		table := c.table()
		insert(t, table, "ok_", 3, day, false)
		r := c.run(testURL, "check", "-table", table, "-horizon", "72h")
		require.Equal(t, exitOK, r.code, "%+v", r)
		assert.Contains(t, r.stdout, "status: ok\n")
		assert.Contains(t, r.stdout, "keys: 3\n")
		assert.Contains(t, r.stdout, "durability (information): no synchronous standby", "the test server has no standby; never a finding")
		assert.Empty(t, r.stderr)

		// Required, the same state is a critical finding (the HA test,
		// internal/hatest, checks a synchronous pair and wait_primary).
		r = c.run(testURL, "check", "-table", table, "-horizon", "72h", "-require-synchronous")
		require.Equal(t, exitCritical, r.code, "%+v", r)
		assert.Contains(t, r.stdout, "durability (required: synchronous, NOT MET): no synchronous standby")
		assert.Contains(t, r.stdout, "CRITICAL not_synchronous: commits do not wait for a synchronous standby")

		insert(t, table, "overdue_", 2, 40*day, false)
		r = c.run(testURL, "check", "-table", table)
		require.Equal(t, exitWarning, r.code, "%+v", r)
		assert.Contains(t, r.stdout, "status: warning\n")
		assert.Contains(t, r.stdout, "WARNING overdue_keys: 2 key(s)")
		assert.Contains(t, r.stdout, "what to do: ")
		r = c.run(testURL, "check", "-table", table, "-retention", "1000h")
		assert.Equal(t, exitOK, r.code, "with the retention the sweeper really uses: %+v", r)

		insert(t, table, "lost_", 1, time.Hour, true)
		r = c.run(testURL, "check", "-table", table)
		require.Equal(t, exitCritical, r.code, "%+v", r)
		assert.Contains(t, r.stdout, "status: critical\n")
		assert.Contains(t, r.stdout, "CRITICAL unanswered_keys:")
		assert.Contains(t, r.stdout, `source "test" event_id "lost_1"`)
		assert.Contains(t, r.stdout, "WARNING overdue_keys:", "every finding is listed")
	})

	t.Run("check -json: the report as a document, with the same exit codes", func(t *testing.T) {
		c := cli{t, c.bin}
		t.Parallel()
		table := c.table()
		r := c.run(testURL, "check", "-table", table, "-json")
		require.Equal(t, exitOK, r.code, "%+v", r)
		doc := parseJSON(t, r.stdout)
		assert.Equal(t, "ok", doc["status"])
		assert.Equal(t, table, doc["table"])
		assert.EqualValues(t, 0, doc["keys"])
		assert.Nil(t, doc["oldest_key"], "no keys: null")
		assert.Nil(t, doc["partitions"], "a plain table")
		assert.Equal(t, []any{}, doc["findings"])
		assert.Equal(t, []any{}, doc["unanswered"])
		assert.EqualValues(t, 72*3600, doc["horizon_seconds"])
		assert.EqualValues(t, 720*3600, doc["retention_seconds"])
		assertStamp(t, doc["checked_at"])
		dur := doc["durability"].(map[string]any)
		assert.Contains(t, dur["summary"], "no synchronous standby")
		assert.Equal(t, false, dur["in_recovery"])
		assert.Equal(t, []any{}, dur["sync_standbys"])
		assert.Equal(t, false, dur["synchronous"])
		assert.Equal(t, false, dur["required"])
		assert.Equal(t, "", dur["synchronous_standby_names"])

		r = c.run(testURL, "check", "-table", table, "-json", "-require-synchronous")
		require.Equal(t, exitCritical, r.code, "%+v", r)
		doc = parseJSON(t, r.stdout)
		dur = doc["durability"].(map[string]any)
		assert.Equal(t, true, dur["required"])
		assert.Equal(t, false, dur["synchronous"])
		findings := doc["findings"].([]any)
		require.Len(t, findings, 1)
		assert.Equal(t, "not_synchronous", findings[0].(map[string]any)["check"])

		insert(t, table, "overdue_", 2, 40*day, false)
		insert(t, table, "lost_", 1, time.Hour, true)
		r = c.run(testURL, "check", "-table", table, "-json")
		require.Equal(t, exitCritical, r.code, "%+v", r)
		assert.Empty(t, r.stderr)
		doc = parseJSON(t, r.stdout)
		assert.Equal(t, "critical", doc["status"])
		assert.EqualValues(t, 3, doc["keys"])
		assert.EqualValues(t, 2, doc["overdue_keys"])
		assert.EqualValues(t, 1, doc["unanswered_keys"])
		assertStamp(t, doc["oldest_key"])
		assert.GreaterOrEqual(t, doc["oldest_age_seconds"], float64(40*24*3600-60))
		var checks []string
		for _, f := range doc["findings"].([]any) {
			f := f.(map[string]any)
			checks = append(checks, f["severity"].(string)+" "+f["check"].(string))
			assert.NotEmpty(t, f["what"])
			assert.NotEmpty(t, f["action"])
		}
		assert.Equal(t, []string{"critical unanswered_keys", "warning overdue_keys"}, checks, "most severe first")
		lost := doc["unanswered"].([]any)
		require.Len(t, lost, 1)
		assert.Equal(t, "test", lost[0].(map[string]any)["source"])
		assert.Equal(t, "lost_1", lost[0].(map[string]any)["event_id"])
		assertStamp(t, lost[0].(map[string]any)["claimed_at"])

		r = c.run(testURL, "check", "-table", table, "-json", "-retention", "1000h")
		assert.Equal(t, exitCritical, r.code, "%+v", r)
		r = c.run(testURL, "check", "-table", "no_such_table", "-json")
		assertOneLineError(t, r, "idem check: ", "does not exist")
	})

	t.Run("stats counts keys by source", func(t *testing.T) {
		c := cli{t, c.bin}
		t.Parallel()
		table := c.table()
		insert(t, table, "a", 3, time.Hour, false)
		insert(t, table, "b", 1, time.Hour, true)
		_, err := testDB.Exec(`UPDATE "` + table + `" SET source = 'github:42' WHERE event_id = 'a3'`)
		require.NoError(t, err)

		r := c.run(testURL, "stats", "-table", table)
		require.Equal(t, 0, r.code, "%+v", r)
		assert.Contains(t, r.stdout, "keys: 4 (completed 3, without an answer 1, leases live 0, leases expired 0)\n")
		assert.Contains(t, r.stdout, "claims in flight: 0\n")
		lines := strings.Split(r.stdout, "\n")
		var rows []string
		for i, l := range lines {
			if strings.HasPrefix(l, "SOURCE") {
				rows = lines[i+1:]
			}
		}
		require.GreaterOrEqual(t, len(rows), 2, r.stdout)
		assert.Regexp(t, `^test\s+2\s+1\s`, rows[0], "the busiest source first")
		assert.Regexp(t, `^github:42\s+1\s+0\s`, rows[1])

		r = c.run(testURL, "stats", "-table", table, "-sources", "1")
		assert.Contains(t, r.stdout, "(and 1 more sources; see -sources)")

		r = c.run(testURL, "stats", "-table", table, "-json")
		require.Equal(t, 0, r.code, "%+v", r)
		doc := parseJSON(t, r.stdout)
		assert.Equal(t, table, doc["table"])
		for k, v := range map[string]int{"keys": 4, "completed": 3, "unanswered": 1, "live_leases": 0, "expired_leases": 0, "in_flight": 0, "other_sources": 0, "partitions_ahead": 0} {
			assert.EqualValues(t, v, doc[k], k)
		}
		assert.Positive(t, doc["table_bytes"])
		assertStamp(t, doc["oldest_key"])
		assertStamp(t, doc["newest_key"])
		assert.Equal(t, []any{}, doc["partitions"], "a plain table")
		sources := doc["sources"].([]any)
		require.Len(t, sources, 2)
		busiest := sources[0].(map[string]any)
		assert.Equal(t, "test", busiest["source"])
		assert.EqualValues(t, 2, busiest["completed"])
		assert.EqualValues(t, 1, busiest["unanswered"])
		assert.EqualValues(t, 0, busiest["leases"])
		assertStamp(t, busiest["oldest"])
		assertStamp(t, busiest["newest"])
		assert.Equal(t, "github:42", sources[1].(map[string]any)["source"])

		doc = parseJSON(t, c.run(testURL, "stats", "-table", table, "-json", "-sources", "1").stdout)
		assert.Len(t, doc["sources"], 1)
		assert.EqualValues(t, 1, doc["other_sources"])
	})

	t.Run("a partitioned table: migrate, sweep, check and stats", func(t *testing.T) {
		c := cli{t, c.bin}
		t.Parallel()
		table := fmt.Sprintf("cmd_part_%d", tableSeq.Add(1))
		r := c.run(testURL, "migrate", "-table", table, "-partition-interval", "24h")
		require.Equal(t, 0, r.code, "%+v", r)
		assert.Equal(t, fmt.Sprintf("created table %q, partitioned on claimed_at, with its index and 4 partitions from the current one\n", table), r.stdout)
		r = c.run(testURL, "migrate", "-table", table, "-partition-interval", "24h")
		require.Equal(t, 0, r.code, "%+v", r)
		// Up to date, unless a UTC day began between the two runs.
		assert.Regexp(t, fmt.Sprintf(`^table %q (is up to date|updated: added 1 partition)\n$`, table), r.stdout)
		assertOneLineError(t, c.run(testURL, "migrate", "-table", c.table(), "-partition-interval", "24h"), "idem migrate: ", "not partitioned", "docs/partitioning.md")
		assertOneLineError(t, c.run(testURL, "migrate", "-table", table, "-partition-interval", "90m"), "idem migrate: ", "whole number of hours")
		insert(t, table, "a", 3, 0, false) // now: the current partition

		r = c.run(testURL, "sweep", "-table", table, "-partitions-ahead", "5")
		require.Equal(t, 0, r.code, "%+v", r)
		assert.Contains(t, r.stdout, fmt.Sprintf("removed 0 expired keys from %q by dropping 0 partitions, added 2 ahead", table))

		r = c.run(testURL, "check", "-table", table)
		require.Equal(t, exitOK, r.code, "%+v", r)
		assert.Regexp(t, `partitions: 6 \(current: `+table+`_p\d{8}_0000; 5 ready ahead, until `, r.stdout)

		r = c.run(testURL, "stats", "-table", table)
		require.Equal(t, 0, r.code, "%+v", r)
		assert.Contains(t, r.stdout, "partitions: 6 (5 ready ahead)")
		assert.Regexp(t, `(?m)^`+table+`_p\d{8}_0000\s+\S+\s+\S+\s+3\s`, r.stdout, "the current partition holds the 3 keys")

		r = c.run(testURL, "check", "-table", table, "-json")
		require.Equal(t, exitOK, r.code, "%+v", r)
		parts := parseJSON(t, r.stdout)["partitions"].(map[string]any)
		assert.EqualValues(t, 6, parts["count"])
		assert.EqualValues(t, 5, parts["ahead"])
		assert.Regexp(t, `^`+table+`_p\d{8}_0000$`, parts["current"])
		assertStamp(t, parts["until"])

		r = c.run(testURL, "stats", "-table", table, "-json")
		require.Equal(t, 0, r.code, "%+v", r)
		doc := parseJSON(t, r.stdout)
		assert.EqualValues(t, 5, doc["partitions_ahead"])
		var keys float64
		list := doc["partitions"].([]any)
		require.Len(t, list, 6)
		for _, p := range list {
			p := p.(map[string]any)
			assert.Regexp(t, `^`+table+`_p\d{8}_0000$`, p["name"])
			assertStamp(t, p["from"])
			assertStamp(t, p["to"])
			keys += p["keys"].(float64)
		}
		assert.EqualValues(t, 3, keys)
	})
}

// parseJSON parses the one JSON document of a -json run.
func parseJSON(t *testing.T, out string) map[string]any {
	t.Helper()
	var doc map[string]any
	dec := json.NewDecoder(strings.NewReader(out))
	require.NoError(t, dec.Decode(&doc), "%s", out)
	require.False(t, dec.More(), "one document: %s", out)
	return doc
}

// assertStamp checks a time of a -json document: RFC 3339, UTC.
func assertStamp(t *testing.T, v any) {
	t.Helper()
	s, ok := v.(string)
	if !assert.True(t, ok, "a time, not %v", v) {
		return
	}
	ts, err := time.Parse(time.RFC3339, s)
	assert.NoError(t, err)
	assert.Equal(t, time.UTC, ts.Location(), s)
}

// versionText is tested on build information of both shapes: with the
// VCS revision a build in a checkout records, and without (a build with
// -buildvcs=false, or from the module cache: go install ...@version).
func TestVersionText(t *testing.T) {
	for name, tc := range map[string]struct {
		bi   *debug.BuildInfo
		want string
	}{
		"installed at a version": {
			&debug.BuildInfo{GoVersion: "go1.26.0", Main: debug.Module{Path: "github.com/pgidem/idem", Version: "v0.1.0"}},
			"idem v0.1.0\nmodule github.com/pgidem/idem\nbuilt with go1.26.0\n",
		},
		"built in a checkout, with its revision": {
			&debug.BuildInfo{GoVersion: "go1.26.0", Main: debug.Module{Path: "github.com/pgidem/idem", Version: "v0.1.1-0.20261202031000-0123456789ab"},
				Settings: []debug.BuildSetting{
					{Key: "-buildmode", Value: "exe"},
					{Key: "vcs", Value: "git"},
					{Key: "vcs.revision", Value: "0123456789abcdef0123456789abcdef01234567"},
					{Key: "vcs.time", Value: "2026-12-02T03:10:00Z"},
					{Key: "vcs.modified", Value: "false"},
				}},
			"idem v0.1.1-0.20261202031000-0123456789ab\nmodule github.com/pgidem/idem\nrevision 0123456789abcdef0123456789abcdef01234567 (2026-12-02T03:10:00Z)\nbuilt with go1.26.0\n",
		},
		"built in a checkout with uncommitted changes": {
			&debug.BuildInfo{GoVersion: "go1.26.0", Main: debug.Module{Path: "github.com/pgidem/idem", Version: "(devel)"},
				Settings: []debug.BuildSetting{{Key: "vcs.revision", Value: "abc"}, {Key: "vcs.modified", Value: "true"}}},
			"idem (devel)\nmodule github.com/pgidem/idem\nrevision abc, with uncommitted changes\nbuilt with go1.26.0\n",
		},
		"built without VCS information": {
			&debug.BuildInfo{GoVersion: "go1.26.0", Main: debug.Module{Path: "github.com/pgidem/idem", Version: "(devel)"},
				Settings: []debug.BuildSetting{{Key: "-buildvcs", Value: "false"}}},
			"idem (devel)\nmodule github.com/pgidem/idem\nbuilt with go1.26.0\n",
		},
		"no version recorded":  {&debug.BuildInfo{}, "idem (devel)\n"},
		"no build information": {nil, "idem (no build information)\n"},
	} {
		assert.Equal(t, tc.want, versionText(tc.bi), name)
	}
}

// A stored body shown with -body cannot drive the terminal: its control
// characters are escaped, newlines and tabs kept.
func TestPrintableEscapesControlCharacters(t *testing.T) {
	got := printable([]byte("ok\n\x1b]0;owned\x07\tdone\u0085"))
	if want := "ok\n\\x1b]0;owned\\x07\tdone\\x85"; got != want {
		t.Fatalf("printable = %q, want %q", got, want)
	}
}
