// Package connstr reads what a PostgreSQL connection string means for a
// failover: which hosts a new connection tries, and whether a host that
// does not answer can hold it up. The idem command and idempgx.New warn
// with it; database/sql's idem.New never sees the connection string.
package connstr

import (
	"context"
	"log/slog"
	"net"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
)

// Hosts returns the distinct host:port pairs that a new connection of cfg
// tries, in order (a host tried with TLS and then without counts once).
func Hosts(cfg *pgconn.Config) []string {
	var hosts []string
	add := func(host string, port uint16) {
		h := net.JoinHostPort(host, strconv.Itoa(int(port)))
		for _, seen := range hosts {
			if seen == h {
				return
			}
		}
		hosts = append(hosts, h)
	}
	add(cfg.Host, cfg.Port)
	for _, f := range cfg.Fallbacks {
		add(f.Host, f.Port)
	}
	return hosts
}

// Warning returns what is wrong with cfg for a failover, or "": more than
// one host and no connect_timeout (nor PGCONNECT_TIMEOUT), so a host that
// accepts TCP but does not answer (a frozen primary) or drops the packets
// holds every new connection until the caller's context ends or TCP gives
// up, and the next host is never tried.
func Warning(cfg *pgconn.Config) string {
	hosts := Hosts(cfg)
	if len(hosts) < 2 || cfg.ConnectTimeout > 0 {
		return ""
	}
	return "idem: the connection string names " + strconv.Itoa(len(hosts)) + " hosts (" + strings.Join(hosts, ", ") +
		") but no connect_timeout: a host that does not answer (a frozen primary, a dropped network) holds every new connection " +
		"until its context ends or TCP gives up, and the next host is never tried; add connect_timeout=5 to it (see docs/ha.md)"
}

// Warn logs Warning's text, if any, at level WARN to logger (slog.Default()
// when nil).
func Warn(logger *slog.Logger, cfg *pgconn.Config) {
	w := Warning(cfg)
	if w == "" {
		return
	}
	if logger == nil {
		logger = slog.Default()
	}
	logger.LogAttrs(context.Background(), slog.LevelWarn, w)
}
