package io.binx.client;

import java.io.IOException;
import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Duration;
import java.time.Instant;
import java.util.ArrayList;
import java.util.Comparator;
import java.util.List;
import java.util.stream.Stream;

/**
 * A real binxd for a test: its own directory, free ports, its Unix socket; stopped and removed
 * on close. The binary comes from the system property {@code binx.binxd} (the Maven build sets
 * it to cargo's target/debug/binxd).
 */
public final class Binxd implements AutoCloseable {
    public final Path dir;
    public final Path socket;
    public final String tcp;
    public final String http;
    private final Process process;
    private final String secret;
    private final String[] extra;
    /** One client for every stats call: a client each would leave a connection each open. */
    private static final java.net.http.HttpClient HTTP = java.net.http.HttpClient.newHttpClient();
    /** False once {@link #restart()} handed the directory to the next process. */
    private volatile boolean ownsDir = true;

    private Binxd(Path dir, Path socket, String tcp, String http, Process process, String secret, String[] extra) {
        this.dir = dir;
        this.socket = socket;
        this.tcp = tcp;
        this.http = http;
        this.process = process;
        this.secret = secret;
        this.extra = extra;
    }

    public static Path binary() {
        String path = System.getProperty("binx.binxd", "../../target/debug/binxd");
        Path p = Path.of(path).toAbsolutePath().normalize();
        if (!Files.isExecutable(p)) {
            throw new IllegalStateException("no binxd at " + p + ": build it first (cargo build), or set -Dbinx.binxd");
        }
        return p;
    }

    public static Binxd start(String... extra) throws IOException, InterruptedException {
        return start(Files.createTempDirectory("binxd-java-test"), "127.0.0.1:0", "127.0.0.1:0", extra);
    }

    /**
     * SIGKILL, then a new binxd on the same Unix socket, directory, arguments and TCP and HTTP
     * ports: a sidecar container restarted in its pod, at the same address, which knows none
     * of the tasks the old one had. This object is then only the dead process; close the one
     * returned.
     */
    public Binxd restart() throws IOException, InterruptedException {
        kill();
        Files.deleteIfExists(socket);
        Files.deleteIfExists(dir.resolve("ready"));
        Files.move(dir.resolve("binxd.log"), dir.resolve("binxd.log." + process.pid()));
        Binxd next = start(dir, tcp, http, extra);
        ownsDir = false;
        return next;
    }

    private static Binxd start(Path dir, String tcpListen, String httpListen, String... extra)
            throws IOException, InterruptedException {
        Path socket = dir.resolve("binx.sock");
        Path ready = dir.resolve("ready");
        List<String> cmd = new ArrayList<>(List.of(binary().toString(),
                "--tcp-listen", tcpListen, "--http-listen", httpListen,
                "--uds-path", socket.toString(), "--ready-file", ready.toString(),
                "--data-dir", dir.resolve("data").toString()));
        cmd.addAll(List.of(extra));
        Process p = new ProcessBuilder(cmd)
                .redirectErrorStream(true)
                .redirectOutput(dir.resolve("binxd.log").toFile())
                .start();
        Instant deadline = Instant.now().plus(Duration.ofSeconds(30));
        while (!Files.exists(ready)) {
            if (!p.isAlive() || Instant.now().isAfter(deadline)) {
                p.destroyForcibly();
                throw new IllegalStateException("binxd did not start: " + Files.readString(dir.resolve("binxd.log")));
            }
            Thread.sleep(20);
        }
        String tcp = null;
        String http = null;
        for (String line : Files.readAllLines(ready)) {
            if (line.startsWith("tcp=")) {
                tcp = line.substring(4);
            } else if (line.startsWith("http=")) {
                http = line.substring(5);
            }
        }
        int at = List.of(extra).indexOf("--shared-secret");
        String secret = at >= 0 && at + 1 < extra.length ? extra[at + 1] : null;
        return new Binxd(dir, socket, tcp, http, p, secret, extra.clone());
    }

    public BinxConnection connect() {
        return BinxConnection.unix(socket, BinxConnection.Options.defaults().withClientName("binx-java-test"));
    }

    public String log() throws IOException {
        return Files.readString(dir.resolve("binxd.log"));
    }

    /** /v1/stats as text (plain HTTP; with the daemon's shared secret, an internal JWT). */
    public String stats() throws IOException, InterruptedException {
        return httpGet("/v1/stats");
    }

    /** /metrics (Prometheus text): the latency histograms by request type among them. */
    public String metrics() throws IOException, InterruptedException {
        return httpGet("/metrics");
    }

    private String httpGet(String path) throws IOException, InterruptedException {
        var req = java.net.http.HttpRequest.newBuilder(java.net.URI.create("http://" + http + path));
        if (secret != null) {
            req.header("X-Trino-Internal-Bearer", internalJwt(secret));
        }
        return HTTP.send(req.build(), java.net.http.HttpResponse.BodyHandlers.ofString()).body();
    }

    /** An HS256 JWT under SHA-256 of the secret (Presto's internal authentication), valid a minute. */
    static String internalJwt(String secret) {
        try {
            var b64 = java.util.Base64.getUrlEncoder().withoutPadding();
            String header = b64.encodeToString("{\"alg\":\"HS256\",\"typ\":\"JWT\"}".getBytes(java.nio.charset.StandardCharsets.UTF_8));
            long exp = System.currentTimeMillis() / 1000 + 60;
            String payload = b64.encodeToString(("{\"sub\":\"binx-test\",\"exp\":" + exp + "}").getBytes(java.nio.charset.StandardCharsets.UTF_8));
            byte[] key = java.security.MessageDigest.getInstance("SHA-256").digest(secret.getBytes(java.nio.charset.StandardCharsets.UTF_8));
            var mac = javax.crypto.Mac.getInstance("HmacSHA256");
            mac.init(new javax.crypto.spec.SecretKeySpec(key, "HmacSHA256"));
            String signature = b64.encodeToString(mac.doFinal((header + "." + payload).getBytes(java.nio.charset.StandardCharsets.US_ASCII)));
            return header + "." + payload + "." + signature;
        } catch (java.security.GeneralSecurityException e) {
            throw new IllegalStateException(e);
        }
    }

    /** One number from /v1/stats. */
    public long stat(String key) throws IOException, InterruptedException {
        String json = stats();
        var m = java.util.regex.Pattern.compile("\"" + key + "\"\\s*:\\s*(\\d+)").matcher(json);
        if (!m.find()) {
            throw new IllegalStateException("no stat " + key + " in " + json);
        }
        return Long.parseLong(m.group(1));
    }

    public boolean alive() {
        return process.isAlive();
    }

    /**
     * The process's peak resident memory so far (VmHWM in /proc/PID/status), in bytes: what
     * the kernel really gave it, whatever binxd counts itself.
     */
    public long peakRssBytes() throws IOException {
        for (String line : Files.readAllLines(Path.of("/proc", Long.toString(process.pid()), "status"))) {
            if (line.startsWith("VmHWM:")) {
                String[] parts = line.substring(6).trim().split("\\s+");
                return Long.parseLong(parts[0]) * 1024;
            }
        }
        throw new IllegalStateException("no VmHWM for binxd " + process.pid());
    }

    /**
     * The CPU time binxd has used so far (user and system, as the kernel counts it), or
     * {@link Duration#ZERO} where the platform does not say.
     */
    public Duration cpuTime() {
        return process.info().totalCpuDuration().orElse(Duration.ZERO);
    }

    /**
     * SIGSTOP: a binxd that is alive, holds its sockets open and answers nothing (a wedged
     * process, or a paused container); {@link #resume} ends it.
     */
    public void suspend() throws IOException, InterruptedException {
        signal("STOP");
        // kill returns once the signal is sent; the process stops a moment later. Until then
        // it could still answer what a test sends next.
        // Every thread of it, as /proc says (state T).
        Path tasks = Path.of("/proc", Long.toString(process.pid()), "task");
        Instant deadline = Instant.now().plus(Duration.ofSeconds(10));
        while (!allStopped(tasks)) {
            if (Instant.now().isAfter(deadline)) {
                throw new IllegalStateException("binxd " + process.pid() + " did not stop");
            }
            Thread.sleep(2);
        }
    }

    private static boolean allStopped(Path tasks) throws IOException {
        try (Stream<Path> threads = Files.list(tasks)) {
            for (Path t : threads.toList()) {
                String stat;
                try {
                    stat = Files.readString(t.resolve("stat"));
                } catch (IOException gone) {
                    continue;
                }
                if (stat.charAt(stat.lastIndexOf(')') + 2) != 'T') {
                    return false;
                }
            }
        }
        return true;
    }

    /** SIGCONT after {@link #suspend}. */
    public void resume() throws IOException, InterruptedException {
        signal("CONT");
    }

    private void signal(String name) throws IOException, InterruptedException {
        // The shell's kill: no procps needed.
        Process kill = new ProcessBuilder("sh", "-c", "kill -" + name + " " + process.pid()).inheritIO().start();
        if (kill.waitFor() != 0) {
            throw new IllegalStateException("kill -" + name + " " + process.pid() + " failed");
        }
    }

    /** SIGKILL: a crash, as far as its clients can tell. */
    public void kill() throws InterruptedException {
        process.destroyForcibly();
        process.waitFor();
    }

    @Override
    public void close() throws IOException {
        try {
            if (process.isAlive()) {
                // A stopped process would keep the SIGTERM pending.
                resume();
            }
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
        } catch (IOException | IllegalStateException e) {
            // it ended in between
        }
        process.destroy();
        try {
            if (!process.waitFor(10, java.util.concurrent.TimeUnit.SECONDS)) {
                process.destroyForcibly();
            }
        } catch (InterruptedException e) {
            process.destroyForcibly();
            Thread.currentThread().interrupt();
        }
        if (!ownsDir) {
            return;
        }
        try (Stream<Path> files = Files.walk(dir)) {
            files.sorted(Comparator.reverseOrder()).forEach(f -> f.toFile().delete());
        }
    }
}
