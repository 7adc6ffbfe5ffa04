package idem

import (
	"bytes"
	"compress/gzip"
	"encoding/binary"
	"encoding/json"
	"io"
	"net/http"
	"slices"
	"strings"
)

// RPC answers that travel as HTTP 200 whatever their outcome: the gRPC
// protocol (its status in the grpc-status trailer, or in the headers of a
// trailers-only answer), gRPC-Web (the same fields in a trailer frame at the
// end of the body, or in the headers) and Connect's streaming protocol (an
// end-of-stream message at the end of the body). A Connect handler serves
// all three; its unary Connect protocol answers errors with HTTP error
// statuses and needs nothing here.
//
// The middleware stores such an answer only when it reads a success in it:
// exactly one grpc-status, "0", or an end-of-stream message without an
// error. Anything else (an error, a status it cannot read, a trailer frame
// compressed other than with gzip, gRPC-Web's base64 text form) is rolled
// back and passed through as the handler wrote it.

// rpcKind tells the answers whose outcome is not their HTTP status.
type rpcKind int

const (
	rpcNone          rpcKind = iota
	rpcGRPC                  // application/grpc, application/grpc+proto, ...
	rpcGRPCWeb               // application/grpc-web, application/grpc-web+proto, ...
	rpcConnectStream         // application/connect+proto, application/connect+json, ...
)

func rpcKindOf(h http.Header) rpcKind {
	ct := h["Content-Type"]
	if len(ct) == 0 {
		return rpcNone
	}
	v := ct[0]
	if len(v) < len("application/grpc") || !strings.EqualFold(v[:len("application/")], "application/") {
		return rpcNone
	}
	sub := strings.ToLower(v[len("application/"):])
	switch {
	case strings.HasPrefix(sub, "grpc-web"):
		return rpcGRPCWeb
	case strings.HasPrefix(sub, "grpc"):
		return rpcGRPC
	case strings.HasPrefix(sub, "connect+"):
		return rpcConnectStream
	}
	return rpcNone
}

// rpcSucceeded reports whether an answer of that kind says its call
// succeeded; true for an answer that is not an RPC one of those kinds.
func rpcSucceeded(kind rpcKind, h http.Header, body []byte) bool {
	switch kind {
	case rpcGRPC:
		st := trailersOf(h)["Grpc-Status"]
		if !declared(h, "Grpc-Status") { // else its values are the trailer's
			st = append(st, h["Grpc-Status"]...) // a trailers-only answer
		}
		return len(st) == 1 && st[0] == "0"
	case rpcGRPCWeb:
		if strings.Contains(strings.ToLower(h.Get("Content-Type")), "grpc-web-text") {
			return false // base64: not read
		}
		st := h.Values("Grpc-Status") // a trailers-only answer
		flags, last, ok := lastFrame(body)
		if ok && flags == 0x81 && strings.EqualFold(h.Get("Grpc-Encoding"), "gzip") {
			last, ok = gunzip(last) // connect-go compresses it with the messages
			flags = 0x80
		}
		if ok && flags == 0x80 {
			st = append(st, frameStatus(last)...)
		}
		return len(st) == 1 && st[0] == "0"
	case rpcConnectStream:
		flags, last, ok := lastFrame(body)
		if !ok || flags != 0x02 { // an end-of-stream message, not compressed
			return false
		}
		var end struct {
			Error json.RawMessage `json:"error"`
		}
		return json.Unmarshal(last, &end) == nil && (end.Error == nil || string(end.Error) == "null")
	}
	return true
}

// lastFrame walks the body's length-prefixed frames (a flags byte, a
// 4-byte big-endian length, the payload) and returns the last one, or
// false if the body is not a sequence of whole frames.
func lastFrame(body []byte) (flags byte, payload []byte, ok bool) {
	for len(body) > 0 {
		if len(body) < 5 {
			return 0, nil, false
		}
		n := binary.BigEndian.Uint32(body[1:5])
		if uint64(len(body)-5) < uint64(n) {
			return 0, nil, false
		}
		flags, payload, ok = body[0], body[5:5+n], true
		body = body[5+n:]
	}
	return flags, payload, ok
}

// gunzip decompresses a gzip-compressed trailer frame.
func gunzip(p []byte) ([]byte, bool) {
	zr, err := gzip.NewReader(bytes.NewReader(p))
	if err != nil {
		return nil, false
	}
	out, err := io.ReadAll(io.LimitReader(zr, 64<<10)) // trailers are small
	return out, err == nil
}

// frameStatus reads the grpc-status values of a gRPC-Web trailer frame:
// header lines "name: value" separated by CRLF.
func frameStatus(p []byte) []string {
	var st []string
	for line := range bytes.SplitSeq(p, []byte("\r\n")) {
		name, value, ok := bytes.Cut(line, []byte(":"))
		if ok && strings.EqualFold(string(bytes.TrimSpace(name)), "grpc-status") {
			st = append(st, string(bytes.TrimSpace(value)))
		}
	}
	return st
}

// trailersOf returns the trailers a handler set on h, by their canonical
// names: the keys with http.TrailerPrefix, and those the Trailer header
// declares (net/http sends the values they have when the handler returns);
// nil if none.
func trailersOf(h http.Header) http.Header {
	var t http.Header
	for k, vs := range h {
		if name, ok := strings.CutPrefix(k, http.TrailerPrefix); ok {
			if t == nil {
				t = http.Header{}
			}
			c := http.CanonicalHeaderKey(name)
			t[c] = append(t[c], vs...)
		}
	}
	for _, decl := range h["Trailer"] {
		for name := range strings.SplitSeq(decl, ",") {
			c := http.CanonicalHeaderKey(strings.TrimSpace(name))
			if vs, ok := h[c]; ok && c != "" {
				if t == nil {
					t = http.Header{}
				}
				t[c] = append(t[c], vs...)
			}
		}
	}
	return t
}

// declared reports whether h's Trailer header declares the canonical name.
func declared(h http.Header, name string) bool {
	for _, decl := range h["Trailer"] {
		for n := range strings.SplitSeq(decl, ",") {
			if http.CanonicalHeaderKey(strings.TrimSpace(n)) == name {
				return true
			}
		}
	}
	return false
}

// takeTrailers moves the trailers out of h, which is about to be sent, and
// declares them in its Trailer header, so that net/http sends them after
// the body on HTTP/1.1 (chunked) and HTTP/2 alike once the caller puts them
// back, after the body is written.
func takeTrailers(h http.Header) http.Header {
	t := trailersOf(h)
	if t == nil {
		delete(h, "Trailer")
		return nil
	}
	for k := range h {
		if strings.HasPrefix(k, http.TrailerPrefix) {
			delete(h, k)
		}
	}
	names := make([]string, 0, len(t))
	for k := range t {
		delete(h, k)
		names = append(names, k)
	}
	slices.Sort(names)
	h["Trailer"] = []string{strings.Join(names, ", ")}
	return t
}

// rpcStoredHeaders is appendHeaderJSON for a gRPC or gRPC-Web answer: the
// replayed headers, Grpc-Encoding (the message cannot be read without it),
// the status of a trailers-only answer (in its headers) and every trailer, under its name with http.TrailerPrefix, as a handler
// sets one.
func rpcStoredHeaders(dst []byte, h http.Header, names []string) []byte {
	all := make(http.Header, len(names)+4)
	keep := names[:len(names):len(names)]
	if !slices.Contains(keep, "Grpc-Encoding") {
		keep = append(keep, "Grpc-Encoding")
	}
	for _, k := range []string{"Grpc-Status", "Grpc-Message", "Grpc-Status-Details-Bin"} {
		if _, ok := h[k]; ok && !declared(h, k) { // a trailers-only answer's status
			keep = append(keep, k)
		}
	}
	for _, k := range keep {
		if vs, ok := h[k]; ok {
			all[k] = vs
		}
	}
	t := trailersOf(h)
	tnames := make([]string, 0, len(t))
	for k, vs := range t {
		all[http.TrailerPrefix+k] = vs
		tnames = append(tnames, http.TrailerPrefix+k)
	}
	slices.Sort(tnames)
	return appendHeaderJSON(dst, all, append(keep, tnames...))
}
