package io.binx.trino;

import java.nio.file.Path;
import java.util.LinkedHashMap;
import java.util.Locale;
import java.util.Map;
import java.util.TreeMap;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

/**
 * The exchange manager's settings, from {@code etc/exchange-manager.properties}. Every property
 * has a default; an unknown property, or a value that does not parse or is out of range, is an
 * error naming it (as airlift's configuration does), so a typo never goes unnoticed.
 */
public record BinxExchangeConfig(
        Path socket,
        String spoolPolicy,
        int maxOutputPartitionCount,
        long sinkBufferBytes,
        int sinkBatchBytes,
        long sourceBufferBytes,
        int sourceConcurrentReaders,
        long sourceHandleTargetBytes,
        long maxPageBytes,
        long maxErrorMillis) {
    /** The properties and their defaults, in the order docs/ENGINES.md lists them. */
    static final Map<String, String> DEFAULTS = defaults();

    private static Map<String, String> defaults() {
        Map<String, String> d = new LinkedHashMap<>();
        d.put("exchange.binx.socket", "/var/run/binx/binx.sock");
        d.put("exchange.binx.spool-policy", "commit");
        d.put("exchange.binx.max-output-partition-count", "1000");
        d.put("exchange.binx.sink-buffer-size", "32MB");
        d.put("exchange.binx.sink-batch-size", "1MB");
        d.put("exchange.binx.source-buffer-size", "32MB");
        d.put("exchange.binx.source-concurrent-readers", "4");
        d.put("exchange.binx.source-handle-target-data-size", "256MB");
        d.put("exchange.binx.max-page-size", "16MB");
        d.put("exchange.binx.max-error-duration", "3m");
        return Map.copyOf(d);
    }

    public static BinxExchangeConfig defaultsOnly() {
        return from(Map.of());
    }

    public static BinxExchangeConfig from(Map<String, String> properties) {
        Map<String, String> p = new TreeMap<>(DEFAULTS);
        for (Map.Entry<String, String> e : properties.entrySet()) {
            if (!DEFAULTS.containsKey(e.getKey())) {
                throw new IllegalArgumentException("unknown exchange manager property " + e.getKey()
                        + " for the binx exchange; known ones: " + new TreeMap<>(DEFAULTS).keySet());
            }
            p.put(e.getKey(), e.getValue().trim());
        }
        String policy = p.get("exchange.binx.spool-policy");
        if (!policy.equals("commit") && !policy.equals("always")) {
            throw new IllegalArgumentException("exchange.binx.spool-policy is " + policy
                    + ": it must be \"commit\" (durable at the task's finish) or \"always\" (durable at every ENQUEUE); "
                    + "fault-tolerant execution needs each task's output to outlive its worker");
        }
        String socket = p.get("exchange.binx.socket");
        if (socket.isEmpty()) {
            throw new IllegalArgumentException("exchange.binx.socket is empty: give the path of the node's binxd Unix socket");
        }
        return new BinxExchangeConfig(
                Path.of(socket),
                policy,
                (int) count(p, "exchange.binx.max-output-partition-count", 1, 65_536),
                size(p, "exchange.binx.sink-buffer-size", 64 << 10, 1L << 34),
                (int) size(p, "exchange.binx.sink-batch-size", 4 << 10, 64 << 20),
                size(p, "exchange.binx.source-buffer-size", 64 << 10, 1L << 34),
                // Each reader keeps up to 3 DATA in flight on the source's one connection (256
                // requests): past 64 readers a send would wait for a slot, holding its reader.
                (int) count(p, "exchange.binx.source-concurrent-readers", 1, 64),
                size(p, "exchange.binx.source-handle-target-data-size", 1, 1L << 40),
                size(p, "exchange.binx.max-page-size", 1, 64L << 20),
                duration(p, "exchange.binx.max-error-duration", 1_000, 24L * 3600 * 1000));
    }

    private static long count(Map<String, String> p, String key, long min, long max) {
        String v = p.get(key);
        long n;
        try {
            n = Long.parseLong(v);
        } catch (NumberFormatException e) {
            throw new IllegalArgumentException(key + " is " + v + ": not a whole number");
        }
        return inRange(key, v, n, min, max);
    }

    private static final Pattern SIZE = Pattern.compile("(\\d+)\\s*([kKmMgGtT]?)B?");

    /** A data size: bytes, or a number with kB, MB, GB or TB (binary units, as Trino's DataSize). */
    static long size(Map<String, String> p, String key, long min, long max) {
        String v = p.get(key);
        Matcher m = SIZE.matcher(v);
        if (!m.matches()) {
            throw new IllegalArgumentException(key + " is " + v + ": not a data size such as 512kB, 32MB or 1GB");
        }
        long n;
        try {
            n = Long.parseLong(m.group(1));
        } catch (NumberFormatException e) {
            throw new IllegalArgumentException(key + " is " + v + ": too large");
        }
        int shift = switch (m.group(2).toLowerCase(Locale.ROOT)) {
            case "k" -> 10;
            case "m" -> 20;
            case "g" -> 30;
            case "t" -> 40;
            default -> 0;
        };
        if (n > (Long.MAX_VALUE >> shift)) {
            throw new IllegalArgumentException(key + " is " + v + ": too large");
        }
        return inRange(key, v, n << shift, min, max);
    }

    private static final Pattern DURATION = Pattern.compile("(\\d+)\\s*(ms|s|m|h)");

    /** A duration: a number with ms, s, m or h; in milliseconds. */
    static long duration(Map<String, String> p, String key, long min, long max) {
        String v = p.get(key);
        Matcher m = DURATION.matcher(v);
        if (!m.matches()) {
            throw new IllegalArgumentException(key + " is " + v + ": not a duration such as 500ms, 30s, 3m or 1h");
        }
        long n = Long.parseLong(m.group(1));
        long unit = switch (m.group(2)) {
            case "ms" -> 1;
            case "s" -> 1_000;
            case "m" -> 60_000;
            default -> 3_600_000;
        };
        if (n > Long.MAX_VALUE / unit) {
            throw new IllegalArgumentException(key + " is " + v + ": too long");
        }
        return inRange(key, v, n * unit, min, max);
    }

    private static long inRange(String key, String v, long n, long min, long max) {
        if (n < min || n > max) {
            throw new IllegalArgumentException(key + " is " + v + ": it must be between " + min + " and " + max);
        }
        return n;
    }
}
