package idemui

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"net/http"
	"strconv"
	"time"

	"github.com/pgidem/idem"
	"github.com/pgidem/idem/idemops"
)

// Releasing a key (Options.AllowRelease): GET /release shows what will be
// deleted and a form with a signed token; POST /release checks the token
// and deletes the key with idemops.ForgetKey.

// tokenTTL is how long a confirmation page's token stays good.
const tokenTTL = 10 * time.Minute

// token signs the release of k, as info shows it, until expiry with the
// handler's secret: a page of another origin cannot read it, so it cannot
// forge the POST; and a key that changed since its confirmation page was
// shown (taken over, completed, claimed again) is not released by it.
func (h *Handler) token(info *idemops.KeyInfo, expiry time.Time) string {
	var exp [8]byte
	binary.BigEndian.PutUint64(exp[:], uint64(expiry.Unix()))
	return base64.RawURLEncoding.EncodeToString(append(exp[:], h.mac(info, exp[:])...))
}

func (h *Handler) mac(info *idemops.KeyInfo, exp []byte) []byte {
	m := hmac.New(sha256.New, h.secret[:])
	m.Write([]byte("idemui release\x00"))
	m.Write(exp)
	for _, s := range []string{info.Key.Source, info.Key.EventID, strconv.Itoa(int(info.State)),
		strconv.FormatInt(info.ClaimedAt.UnixNano(), 10), strconv.FormatInt(info.CompletedAt.UnixNano(), 10)} {
		m.Write([]byte(s))
		m.Write([]byte{0})
	}
	return m.Sum(nil)
}

// checkToken reports whether tok is a token, not expired, for the key as
// info shows it now.
func (h *Handler) checkToken(info *idemops.KeyInfo, tok string, now time.Time) bool {
	b, err := base64.RawURLEncoding.DecodeString(tok)
	if err != nil || len(b) != 8+sha256.Size {
		return false
	}
	if now.After(time.Unix(int64(binary.BigEndian.Uint64(b[:8])), 0)) {
		return false
	}
	return hmac.Equal(b[8:], h.mac(info, b[:8]))
}

// releaseData is the confirmation page's data.
type releaseData struct {
	Key   idem.Key
	Info  *idemops.KeyInfo
	Token string
	Error string
}

// showKey reads k for a release page; nil when it answered instead (not
// found, or an error).
func (h *Handler) showKey(w http.ResponseWriter, r *http.Request, k idem.Key) *idemops.KeyInfo {
	info, err := idemops.ShowKey(r.Context(), h.db, idemops.KeyOptions{Table: h.opts.Table, Key: k})
	switch {
	case errors.Is(err, idemops.ErrKeyNotFound):
		h.render(w, http.StatusNotFound, "key", "Key not found", keyData{Key: k})
		return nil
	case err != nil:
		h.fail(w, r, err)
		return nil
	}
	return info
}

func (h *Handler) confirmRelease(w http.ResponseWriter, r *http.Request) {
	k := idem.Key{Source: r.FormValue("source"), EventID: r.FormValue("id")}
	if info := h.showKey(w, r, k); info != nil {
		h.render(w, http.StatusOK, "release", "Release a key", releaseData{Key: k, Info: info, Token: h.token(info, time.Now().Add(tokenTTL))})
	}
}

func (h *Handler) release(w http.ResponseWriter, r *http.Request) {
	k := idem.Key{Source: r.PostFormValue("source"), EventID: r.PostFormValue("id")}
	now := h.showKey(w, r, k)
	if now == nil {
		return
	}
	if !h.checkToken(now, r.PostFormValue("token"), time.Now()) {
		h.render(w, http.StatusForbidden, "message", "Forbidden",
			"The release was refused: its token is missing, expired or for another key, or the key changed since its confirmation page was shown. Open the key's page and release it from there again.")
		return
	}
	actor := ""
	if h.opts.Actor != nil {
		actor = h.opts.Actor(r)
	} else if user, _, ok := r.BasicAuth(); ok {
		actor = user
	}
	_, err := idemops.ForgetKey(r.Context(), h.db, idemops.ForgetOptions{
		Table: h.opts.Table, Key: k, Force: r.PostFormValue("force") == "on",
		Reason: r.PostFormValue("reason"), Actor: actor, Logger: h.log,
	})
	switch {
	case errors.Is(err, idemops.ErrKeyInFlight), errors.Is(err, idemops.ErrLeaseLive):
		info, ierr := idemops.ShowKey(r.Context(), h.db, idemops.KeyOptions{Table: h.opts.Table, Key: k})
		d := releaseData{Key: k, Info: info, Error: oneLine(err)}
		if ierr == nil {
			d.Token = h.token(info, time.Now().Add(tokenTTL))
		}
		h.render(w, http.StatusConflict, "release", "Release refused", d)
		return
	case errors.Is(err, idemops.ErrKeyNotFound):
		h.render(w, http.StatusNotFound, "key", "Key not found", keyData{Key: k})
		return
	case err != nil:
		h.fail(w, r, err)
		return
	}
	h.dropFromSnapshot(k)
	seeOther(w, "key?source="+queryEscape(k.Source)+"&id="+queryEscape(k.EventID)+"&done=released")
}

// dropFromSnapshot removes a released key from the snapshot's problem
// lists, so that they do not show it until the next refresh.
func (h *Handler) dropFromSnapshot(k idem.Key) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.snap == nil {
		return
	}
	s := *h.snap
	s.Open = nil
	for _, o := range h.snap.Open {
		if o.Key != k {
			s.Open = append(s.Open, o)
		}
	}
	h.snap = &s
}

// oneLine is err's text without the library's prefixes.
func oneLine(err error) string {
	s := err.Error()
	for _, p := range []string{"idem: "} {
		for len(s) >= len(p) && s[:len(p)] == p {
			s = s[len(p):]
		}
	}
	return s
}
