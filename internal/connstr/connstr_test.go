package connstr

import (
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestWarning(t *testing.T) {
	t.Setenv("PGCONNECT_TIMEOUT", "")
	for _, tc := range []struct {
		name, url string
		hosts     []string
		warns     bool
	}{
		{"one host", "postgres://u@db1:5432/app", []string{"db1:5432"}, false},
		{"one host, TLS then plain (sslmode=prefer) counts once", "postgres://u@db1:5432/app?sslmode=prefer", []string{"db1:5432"}, false},
		{"two hosts without connect_timeout", "postgres://u@db1:5432,db2:5433/app?target_session_attrs=read-write", []string{"db1:5432", "db2:5433"}, true},
		{"two hosts with connect_timeout", "postgres://u@db1:5432,db2:5432/app?target_session_attrs=read-write&connect_timeout=5", []string{"db1:5432", "db2:5432"}, false},
		{"keyword/value form", "host=db1,db2 port=5432,5432 user=u dbname=app target_session_attrs=read-write", []string{"db1:5432", "db2:5432"}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg, err := pgconn.ParseConfig(tc.url)
			require.NoError(t, err)
			assert.Equal(t, tc.hosts, Hosts(cfg))
			w := Warning(cfg)
			if !tc.warns {
				assert.Empty(t, w)
				return
			}
			assert.Contains(t, w, "no connect_timeout")
			assert.Contains(t, w, tc.hosts[1])
		})
	}

	t.Run("PGCONNECT_TIMEOUT counts as connect_timeout", func(t *testing.T) {
		t.Setenv("PGCONNECT_TIMEOUT", "5")
		cfg, err := pgconn.ParseConfig("postgres://u@db1:5432,db2:5432/app")
		require.NoError(t, err)
		assert.Empty(t, Warning(cfg))
	})
}

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
